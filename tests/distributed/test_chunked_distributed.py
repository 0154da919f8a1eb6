"""loss=chunked under DDP, DeepSpeed ZeRO-2/3 and FSDP2 (CPU/gloo, 2 processes) against one process with the
standard loss, on an untied and a tied-embedding model (the same harness as
tests/distributed/test_distributed_train.py)."""

import json
from pathlib import Path

import pytest

from conftest import reference_losses
from memfit.distributed.launch import torchrun_command
from test_distributed_train import _run

pytestmark = pytest.mark.slow
STEPS = 3
CHUNKED = ["strategy.loss=chunked"]
CASES = {
    "ddp-full": ["method=full"],
    "z2-lora": ["method=lora", "strategy.zero_stage=2"],
    "z3-full": ["method=full", "strategy.zero_stage=3"],
    "z3-lora": ["method=lora", "strategy.zero_stage=3"],
    "fsdp-full": ["method=full", "strategy.fsdp=full_shard"],
    "fsdp-lora": ["method=lora", "strategy.fsdp=full_shard"],
}


def _tiny(root: Path, tied: bool, texts) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from memfit.train.demo import TinyModelConfig, build_tiny_model

    cfg = TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=384, max_position_embeddings=128)
    path = build_tiny_model(root / "micro", cfg, texts=texts)
    if not tied:
        return path
    tied_path = root / "micro-tied"
    if not tied_path.is_dir():
        import shutil

        shutil.copytree(path, tied_path)
        conf = LlamaConfig.from_pretrained(str(path))
        conf.tie_word_embeddings = True
        torch.manual_seed(0)
        LlamaForCausalLM(conf).save_pretrained(str(tied_path), safe_serialization=True)
    return tied_path


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def results(request, tmp_path_factory):
    import yaml

    from memfit.train.demo import make_dialogue_records, write_jsonl

    root = tmp_path_factory.mktemp("chunked-dist")
    records = make_dialogue_records(48, seed=0)
    write_jsonl(records, root / "data.jsonl")
    model = _tiny(root, request.param, [r["dialogue"] + "\n" + r["summary"] for r in records])
    base = {"model": str(model),
            "data": {"path": str(root / "data.jsonl"), "format": "dialogue_summary", "eval_fraction": 0.0},
            "strategy": {"method": "lora", "precision": "fp32", "micro_batch_size": 1, "seq_len": 64,
                         "lora_dropout": 0.0, "lora_r": 4, "lora_alpha": 8, "grad_accum": 2},
            "training": {"max_steps": STEPS, "learning_rate": 0.01, "lr_scheduler": "constant"}}

    def write(name, out, cases):
        (root / f"{name}.yaml").write_text(yaml.safe_dump({**base, "output_dir": str(root / out)}))
        (root / f"{name}-cases.json").write_text(json.dumps(cases))
        return [str(root / f"{name}.yaml"), str(root / f"{name}-cases.json"), str(root / f"{name}.json")]

    dist = write("dist", "out2", [{"name": k, "set": v + CHUNKED} for k, v in CASES.items()])
    (root / "ref.yaml").write_text(yaml.safe_dump({**base, "output_dir": str(root / "out1")}))
    _run(torchrun_command("memfit.measure.engine_matrix", dist, nproc=2), root, timeout=900)
    ref = {m: reference_losses(root / "ref.yaml", [f"method={m}", "strategy.micro_batch_size=2"], m)
           for m in ("full", "lora")}
    return json.loads(Path(dist[2]).read_text())["cases"], ref


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_loss_matches_one_standard_process(results, case):
    dist, ref = results
    want = ref[case.split("-")[1]]
    got = dist[case]["losses"]
    assert len(got) == len(want) == STEPS
    assert got == pytest.approx(want, rel=1e-4, abs=1e-4)
    assert want[-1] < want[0]
