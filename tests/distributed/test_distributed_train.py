"""DeepSpeed ZeRO-1/2/3 (+ offload) and FSDP2 on CPU/gloo, 2 processes, against one process.

One torchrun launch runs every strategy in sequence in one process group (memfit.measure.engine_matrix),
through memfit.train and the Hugging Face Trainer, as a user's run would. The single-process reference
sees the same global batches (micro-batch 2 on one process = micro-batch 1 on each of two).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memfit.distributed.launch import torchrun_command

LORA = ["method=lora"]
FULL = ["method=full"]
ENGINES = {
    "z1": ["strategy.zero_stage=1"],
    "z2": ["strategy.zero_stage=2"],
    "z3": ["strategy.zero_stage=3"],
    "z3off": ["strategy.zero_stage=3", "strategy.offload=optimizer"],
    "fsdp": ["strategy.fsdp=full_shard"],
}
STEPS = 3


def _env() -> dict:
    # PYTHONFAULTHANDLER: a rank that dies of a signal prints where every thread was
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", MEMFIT_QUIET="1",
               PYTHONFAULTHANDLER="1")
    env.pop("WORLD_SIZE", None)
    return env


def _run(cmd: list, cwd: Path, timeout: int = 900) -> None:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    # a rank that died of a signal: faulthandler's thread dump (where every thread was) before the tail
    fatal = proc.stderr.find("Fatal Python error")
    dump = proc.stderr[fatal:fatal + 4000] + "\n...\n" if fatal >= 0 else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + dump + proc.stderr[-6000:]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, tiny_model_dir):
    from conftest import lora_dialogue_run

    root = tmp_path_factory.mktemp("dist")
    base = lora_dialogue_run(root, tiny_model_dir, "dist", records=48, seq_len=64, max_steps=STEPS)
    import yaml

    def write(name, output_dir, cases):
        (root / f"{name}.yaml").write_text(yaml.safe_dump({**base, "output_dir": str(output_dir)}))
        (root / f"{name}-cases.json").write_text(json.dumps(cases))
        return [str(root / f"{name}.yaml"), str(root / f"{name}-cases.json"), str(root / f"{name}.json")]

    cases = [{"name": "ddp-full", "set": FULL}]
    for key, sets in ENGINES.items():
        cases += [{"name": f"{key}-lora", "set": LORA + sets}, {"name": f"{key}-full", "set": FULL + sets}]
    # FSDP / ZeRO-3 + QLoRA: 4-bit weights stored in the FSDP param dtype (fp32 here), no k-bit upcasts
    qlora = ["method=qlora", "strategy.quant_storage=fp32"]
    cases += [{"name": "fsdp-qlora", "set": qlora + ENGINES["fsdp"]},
              {"name": "z3-qlora", "set": qlora + ENGINES["z3"]}]
    bf16 = ["strategy.precision=bf16-mixed"]  # DeepSpeed's bf16 section and FSDP2's mixed precision
    cases += [{"name": "z2-bf16", "set": LORA + bf16 + ENGINES["z2"]},
              {"name": "fsdp-bf16", "set": LORA + bf16 + ENGINES["fsdp"]}]
    gc = ["strategy.gradient_checkpointing=true"]
    cases += [{"name": "z3offp-lora",
               "set": LORA + gc + ["strategy.zero_stage=3", "strategy.offload=optimizer+params"]},
              {"name": "sgo-lora", "set": LORA + gc + ["strategy.fsdp=shard_grad_op"]}]
    for key in ("z3", "fsdp"):  # sharded checkpoint after 2 steps, then resume to step 3
        ckpt = ["training.max_steps=2", "training.checkpoint_interval=2"]
        cases += [{"name": f"{key}-ckpt", "set": LORA + ENGINES[key] + ckpt},
                  {"name": f"{key}-resume", "dir": f"{key}-ckpt", "set": LORA + ENGINES[key], "resume": True}]
    dist_args = write("dist", root / "out2", cases)
    ref_args = write("ref", root / "out1", [{"name": "lora", "set": LORA + ["strategy.micro_batch_size=2"]},
                                            {"name": "full", "set": FULL + ["strategy.micro_batch_size=2"]},
                                            {"name": "qlora", "set": ["method=qlora", "strategy.micro_batch_size=2"]},
                                            {"name": "lora-bf16", "set": LORA + ["strategy.precision=bf16-mixed",
                                                                                 "strategy.micro_batch_size=2"]},
                                            # ZeRO without a launcher: a one-process group
                                            {"name": "z2-alone",
                                             "set": LORA + ENGINES["z2"] + ["strategy.micro_batch_size=2"]}])
    _run(torchrun_command("memfit.measure.engine_matrix", dist_args, nproc=2), root)
    _run([sys.executable, "-m", "memfit.measure.engine_matrix", *ref_args], root)
    dist = json.loads(Path(dist_args[2]).read_text())
    ref = json.loads(Path(ref_args[2]).read_text())
    assert dist["world_size"] == 2 and ref["world_size"] == 1
    return dist["cases"], ref["cases"], root


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("method", ["lora", "full"])
def test_losses_match_single_process(matrix, engine, method):
    dist, ref, _ = matrix
    got, want = dist[f"{engine}-{method}"]["losses"], ref[method]["losses"]
    assert len(got) == len(want) == STEPS
    assert got == pytest.approx(want, rel=1e-4, abs=1e-4)
    assert want[-1] < want[0]  # it learned something: the comparison is not of constants


def _state(case):
    ranks = case["ranks"]
    assert len(ranks) == 2 and ranks[0]["parameters"] > 0
    return ranks[0]


def test_per_rank_model_states_shrink_with_the_stage(matrix):
    dist, _, _ = matrix
    ddp, z1, z2, z3, fsdp = (_state(dist[f"{k}-full"]) for k in ("ddp", "z1", "z2", "z3", "fsdp"))
    full_params = ddp["parameters"]
    # ZeRO-1/2 keep whole parameters but only half of Adam's state (+ half an fp32 master copy).
    assert z1["parameters"] == z2["parameters"] == full_params
    assert z1["optimizer"] == pytest.approx(0.75 * ddp["optimizer"], rel=0.02)
    # ZeRO-3 and FSDP also shard the parameters: half each on 2 ranks.
    for sharded in (z3, fsdp):
        assert sharded["parameters"] == pytest.approx(full_params / 2, rel=0.02)
        assert sharded["optimizer"] == pytest.approx(ddp["optimizer"] / 2, rel=0.02)
    held = [s["parameters"] + s["optimizer"] for s in (ddp, z1, z2, z3)]
    assert held == sorted(held, reverse=True) and held[-1] < 0.55 * held[0]
    # both ranks hold the same share
    for key in ("z3-full", "fsdp-full"):
        assert dist[key]["ranks"][0]["parameters"] == dist[key]["ranks"][1]["parameters"]


def _tensors(folder):
    from safetensors.numpy import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    assert files, f"nothing saved in {folder}"
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("engine", ["z2", "fsdp"])
def test_bf16_mixed(matrix, engine):
    dist, ref, _ = matrix
    # bf16 rounding (FSDP2 also casts the parameters for compute): agreement to about 1e-2
    assert dist[f"{engine}-bf16"]["losses"] == pytest.approx(ref["lora-bf16"]["losses"], rel=5e-3)


def test_zero_without_launcher(matrix):
    _, ref, _ = matrix
    assert ref["z2-alone"]["losses"] == pytest.approx(ref["lora"]["losses"], rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("case", ["z3offp-lora", "sgo-lora"])
def test_param_offload_shard_grad_op_and_checkpointing(matrix, case):
    dist, ref, _ = matrix
    assert dist[case]["losses"] == pytest.approx(ref["lora"]["losses"], rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("engine", ["fsdp", "z3"])
def test_sharded_qlora_matches_one_process(matrix, engine):
    dist, ref, _ = matrix
    assert dist[f"{engine}-qlora"]["losses"] == pytest.approx(ref["qlora"]["losses"], rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("engine, method", [("z3", "lora"), ("z3off", "lora"), ("fsdp", "lora"),
                                            ("fsdp", "qlora"), ("z3", "qlora")])
def test_saved_adapter_is_gathered_and_matches(matrix, engine, method):
    import numpy as np

    dist, ref, _ = matrix
    got, want = _tensors(dist[f"{engine}-{method}"]["saved_to"]), _tensors(ref[method]["saved_to"])
    assert sorted(got) == sorted(want) and any("lora_B" in k for k in got)
    for k in want:
        assert got[k].shape == want[k].shape, k  # not ZeRO-3's empty local shards
        np.testing.assert_allclose(got[k], want[k], atol=2e-4, rtol=1e-3)
    assert max(float(np.abs(v).max()) for k, v in got.items() if "lora_B" in k) > 0  # trained


@pytest.mark.parametrize("engine", ["z3", "fsdp"])
def test_saved_full_model_is_whole(matrix, engine):
    import numpy as np

    dist, ref, _ = matrix
    got, want = _tensors(dist[f"{engine}-full"]["saved_to"]), _tensors(ref["full"]["saved_to"])
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].shape == want[k].shape, k
        np.testing.assert_allclose(got[k], want[k], atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("engine", ["z3", "fsdp"])
def test_resume_from_sharded_checkpoint(matrix, engine):
    dist, _, root = matrix
    ckpt, resumed, straight = dist[f"{engine}-ckpt"], dist[f"{engine}-resume"], dist[f"{engine}-lora"]
    assert ckpt["steps"] == 2 and resumed["steps"] == STEPS
    assert (root / "out2" / f"{engine}-ckpt" / "checkpoint-2").is_dir()
    assert resumed["losses"] == pytest.approx(straight["losses"][2:], rel=1e-4, abs=1e-4)


def test_engine_configs_written_and_adapter_reloads(matrix):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    dist, _, root = matrix
    out = root / "out2" / "z3off-lora"
    ds = json.loads((out / "deepspeed.json").read_text())
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    import yaml

    acc = yaml.safe_load((out / "accelerate.yaml").read_text())
    assert acc["distributed_type"] == "DEEPSPEED" and acc["num_processes"] == 2
    assert yaml.safe_load((root / "out2" / "fsdp-lora" / "accelerate.yaml").read_text())["distributed_type"] == "FSDP"

    base = AutoModelForCausalLM.from_pretrained(yaml.safe_load((root / "dist.yaml").read_text())["model"])
    ids = torch.arange(12).unsqueeze(0)
    with torch.no_grad():
        before = base(ids).logits
        model = PeftModel.from_pretrained(base, dist["z3off-lora"]["saved_to"])
        after = model(ids).logits
    assert not torch.allclose(before, after)  # the trained adapter changes the output


def test_summary_predicts_per_rank_bytes_at_world_two(matrix):
    """The 2-process ZeRO-3 summary predicts what one rank of two holds, not a one-process run."""
    import dataclasses

    from memfit.estimate import estimate
    from memfit.spec.hardware import parse_hardware
    from memfit.spec.model import resolve_model
    from memfit.spec.run import load_run

    _, _, root = matrix
    summary = json.loads((root / "out2" / "z3-full" / "summary.json").read_text())
    run = load_run(root / "out2" / "z3-full" / "run.yaml")
    assert run.distributed.nproc == 2 and run.strategy.zero_stage == 3
    local = parse_hardware("local", cpu_ram=run.cpu_ram)
    model = resolve_model(run.model)
    want = estimate(model, dataclasses.replace(local, gpus_per_node=2), run.strategy).to_dict()
    one = estimate(model, local, run.strategy).to_dict()
    got = summary["predicted"]["memory"]["gpu_bytes"]
    assert got["total"] == want["memory"]["gpu_bytes"]["total"]
    assert got["total"] < one["memory"]["gpu_bytes"]["total"]
