"""The base model of bench/studies/meft_knowledge.py: shipped pre-trained weights (bench/studies/assets/meft_base/),
or a fresh pre-training through ``memfit train`` (method full) with ``--pretrain``.

Pre-training in every bench run made the base -- and so every method's starting point -- depend on the CPU's
floating-point path (two machines gave two orderings of MEFT and LoRA, docs/meft.md). The bench now loads
the weights made once by ``bench/studies/meft_knowledge.py --ship-base`` (safetensors, config, tokenizer; how they
were made is in made.json beside them) and only re-pre-trains when asked. Nothing here unpickles: the
weights load through safetensors (``use_safetensors=True``), the rest is JSON.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

ASSET = Path(__file__).resolve().parent / "assets" / "meft_base"
SHIPPED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json")


def write_task(workdir: Path, setup) -> dict:
    """The task's files in ``workdir`` (task.json, pretrain.jsonl, finetune.jsonl); the task."""
    from bench.studies.meft_knowledge_data import make_task, write_jsonl

    task = make_task(setup.task, seed=0)
    (workdir / "task.json").write_text(json.dumps(task))
    write_jsonl(task["pretrain"], workdir / "pretrain.jsonl")
    write_jsonl(task["new_facts"] + task["copy_train"], workdir / "finetune.jsonl")
    return task


def base_scores(model_dir: Path, task: dict, batch: int) -> dict:
    """The base model's scores before any fine-tuning (step 0): recall of the new facts, the control task."""
    import torch
    from transformers import AutoModelForCausalLM

    from bench.studies.meft_knowledge_probe import scores

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), use_safetensors=True, dtype=torch.float32)
    return scores(model, task, batch)


def shipped(workdir: Path, setup) -> dict:
    """The shipped base for this task: its folder, how it was made, and its step-0 scores."""
    from bench.studies.meft_knowledge_data import ModelSize

    if setup.model != ModelSize():
        raise SystemExit(f"the shipped base is {asdict(ModelSize())}; for {asdict(setup.model)} pass --pretrain")
    if not (ASSET / "model.safetensors").is_file():
        raise SystemExit(f"no shipped base in {ASSET}: run bench/studies/meft_knowledge.py --ship-base once")
    task = write_task(workdir, setup)
    made = json.loads((ASSET / "made.json").read_text())
    return {"saved_to": str(ASSET), "source": "shipped", "made": made,
            **base_scores(ASSET, task, setup.batch)}


def pretrained(workdir: Path, setup, run_dict, Job, run_jobs) -> dict:
    """Pre-trains a random-init base through memfit (method full) in ``workdir``; a workdir that already
    holds the pre-training of the same task, model and steps is reused. Its result row carries the step-0
    (after pre-training, before fine-tuning) scores."""
    from bench.studies.meft_knowledge_data import build_model

    key = json.dumps([asdict(setup.task), asdict(setup.model), setup.pretrain_steps, setup.pretrain_lr,
                      setup.batch, setup.seq_len])
    cached = workdir / "pretrain.json"
    write_task(workdir, setup)
    if cached.is_file() and json.loads(cached.read_text()).get("key") == key:
        return json.loads(cached.read_text())["result"]
    base = build_model(workdir / "base", setup.model, seed=0)
    run = run_dict(str(base), str(workdir / "pretrain.jsonl"), str(workdir / "pretrain"), {"method": "full"},
                   setup.pretrain_steps, setup.pretrain_lr, 0, setup)
    pre = run_jobs([Job("pretrain", "pretrain", setup.pretrain_lr, 0, run, str(workdir), setup.batch)], 1)[0]
    result = {**pre.result, "source": "pretrained"}
    cached.write_text(json.dumps({"key": key, "result": result}, default=str))
    return result


def ship(pre: dict, setup, command: str, dest: Path = ASSET) -> Path:
    """Copies a pre-trained base's weights, config and tokenizer to ``dest`` with made.json: the command, the
    commit, the date, the setup, the pre-training's losses and step-0 recall, and the weights' sha256."""
    src = Path(pre["saved_to"])
    dest.mkdir(parents=True, exist_ok=True)
    for name in SHIPPED_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dest / name)
    root = Path(__file__).resolve().parents[2]
    try:  # read-only git: no index refresh
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=root).stdout.strip()
        dirty = bool(subprocess.run(["git", "--no-optional-locks", "status", "--porcelain", "bench/"],
                                    capture_output=True, text=True, cwd=root).stdout.strip())
    except OSError:
        commit, dirty = "", False
    made = {"command": command, "commit": commit, "bench_files_modified": dirty, "date": time.strftime("%Y-%m-%d"),
            "how": "random-init Llama from a config (meft_knowledge_data.build_model, torch seed 0), pre-trained "
                   "through memfit's training path (method full, fp32, constant lr after 10 warm-up steps) on "
                   "the task's pretrain split (facts of the old entities + copy examples), make_task seed 0",
            "model": asdict(setup.model), "task": asdict(setup.task), "pretrain_steps": setup.pretrain_steps,
            "pretrain_lr": setup.pretrain_lr, "batch": setup.batch, "seq_len": setup.seq_len,
            "first_loss": pre.get("first_loss"), "final_loss": pre.get("final_loss"),
            "step0_recall_test": pre.get("recall"), "step0_recall_val": pre.get("recall_val"),
            "step0_control": pre.get("control"),
            "sha256": {n: hashlib.sha256((dest / n).read_bytes()).hexdigest() for n in SHIPPED_FILES
                       if (dest / n).is_file()}}
    (dest / "made.json").write_text(json.dumps(made, indent=1) + "\n")
    return dest
