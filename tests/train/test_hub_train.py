"""`memfit train` with a Hub id as its model: the weights load by id through transformers and the HF cache.

A tiny model's files (config.json, safetensors, tokenizer) are laid out in a fresh ``HF_HOME`` as the HF
cache documents (``models--owner--name/snapshots/<commit>/`` + ``refs/main``), and the run trains in a
fresh process under ``HF_HUB_OFFLINE=1``: nothing of memfit's is mocked, nothing reaches a network.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from memfit.spec.run import run_from_dict, save_run  # noqa: E402
from memfit.train.demo import make_dialogue_records, write_jsonl  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


def _cache(home: Path, repo: str, model: Path) -> None:
    snap = home / "hub" / ("models--" + repo.replace("/", "--")) / "snapshots" / COMMIT
    shutil.copytree(model, snap)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text(COMMIT)


def _env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", PYTHONPATH=str(ROOT))
    return env


def test_train_by_hub_id_from_the_cache(tmp_path, tiny_model_dir):
    recs = make_dialogue_records(24, seed=3)
    model = tiny_model_dir("hub", [r["dialogue"] + "\n" + r["summary"] for r in recs])
    _cache(tmp_path / "hf", "acme/tiny-llama", model)
    run = run_from_dict({"model": "acme/tiny-llama", "data": {"path": str(write_jsonl(recs, tmp_path / "d.jsonl"))},
                         "strategy": {"precision": "fp32", "seq_len": 64, "micro_batch_size": 2, "lora_r": 4},
                         "training": {"max_steps": 2}, "output_dir": str(tmp_path / "out")})
    path = save_run(run, tmp_path / "run.yaml")
    p = subprocess.run([sys.executable, "-m", "memfit", "train", str(path), "--json"], env=_env(tmp_path / "hf"),
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout)
    assert result["steps"] == 2
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()

    # a Hub id the cache does not hold: one line before anything loads
    missing = save_run(run.model_copy(update={"model": "acme/not-cached",
                                                  "output_dir": str(tmp_path / "out2")}), tmp_path / "missing.yaml")
    p = subprocess.run([sys.executable, "-m", "memfit", "train", str(missing)], env=_env(tmp_path / "hf"),
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "config.json is not in the cache and the Hub is unreachable (HF_HUB_OFFLINE=1?)" in p.stderr
