"""Pre-flight checks: each problem is found before weights load, with what to change."""

import subprocess
import sys

import pytest
import yaml

from memfit.distributed import preflight
from memfit.errors import IncompatibleError
from memfit.spec.hardware import parse_hardware
from memfit.spec.model import resolve_model
from memfit.spec.run import run_from_dict


def _run(strategy=None, **extra):
    return run_from_dict({"model": "llama-2-7b", "strategy": strategy or {}, **extra})


def test_world_size_against_run_file():
    run = _run(distributed={"nproc": 4, "nodes": 2})
    assert preflight.world_reasons(run, 8, 4, 4) == []
    (msg,) = preflight.world_reasons(run, 4, 4, 4)
    assert "4 process(es) were launched" in msg and "nproc=4 x nodes=2 = 8" in msg
    (msg,) = preflight.world_reasons(_run(distributed={"nproc": 8}), 8, 8, 2)
    assert "8 processes on this node but it has 2 CUDA GPU(s)" in msg and "--nproc 2" in msg


@pytest.mark.parametrize("strategy, needle", [
    ({"fsdp": "full_shard", "offload": "optimizer"}, "offload=optimizer+params"),
    ({"zero_stage": 2, "offload": "optimizer", "optimizer": "adamw8bit"}, "32-bit AdamW"),
    ({"zero_stage": 3, "offload": "optimizer", "optimizer": "sgd"}, "ZeRO-Offload"),
])
def test_engine_offload_combinations(strategy, needle):
    reasons = preflight.engine_reasons(_run(strategy), cpu=False)
    assert len(reasons) == 1 and needle in reasons[0]


def test_fsdp_offload_needs_cuda():
    run = _run({"fsdp": "full_shard", "offload": "optimizer+params"})
    assert preflight.engine_reasons(run, cpu=False) == []
    (msg,) = preflight.engine_reasons(run, cpu=True)
    assert "pins host memory" in msg and "offload=none" in msg


def test_missing_deepspeed(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    (msg,) = preflight.engine_reasons(_run({"zero_stage": 2}), cpu=False)
    assert "pip install deepspeed" in msg
    assert preflight.engine_reasons(_run({"fsdp": "full_shard"}), cpu=False) == []


def test_planner_rules_and_cpu_offload():
    model, cpu = resolve_model("llama-2-7b"), parse_hardware("local", cpu_ram="64GB")
    if not cpu.gpu.is_cpu:
        pytest.skip("this machine has a GPU")
    # ZeRO offload runs on the CPU (the same code as on GPUs, nothing saved): allowed at train time
    assert preflight.rule_reasons(_run({"zero_stage": 3, "offload": "optimizer"}), model, cpu) == []
    reasons = preflight.rule_reasons(_run({"attention": "fa2"}), model, cpu)
    assert any("fa2" in r for r in reasons)
    v100 = parse_hardware("2xV100-32GB")
    qlora = _run({"method": "qlora", "zero_stage": 3, "quant_storage": "uint8", "precision": "fp16-mixed"})
    assert any("quant_storage=fp16" in r for r in preflight.rule_reasons(qlora, model, v100))
    assert any("bf16" in r for r in preflight.rule_reasons(_run({"precision": "bf16-mixed"}), model, v100))


def test_cpu_ram_for_offload_from_the_estimate():
    model = resolve_model("llama-2-7b")
    run = _run({"zero_stage": 3, "offload": "optimizer+params", "method": "full"},
               distributed={"nproc": 2})
    small = parse_hardware("2xRTX3090-24GB", cpu_ram="16GB")
    (msg,) = preflight.ram_reasons(run, model, small)
    assert "GB of CPU RAM per node" in msg and "16.0 GB" in msg
    assert preflight.ram_reasons(run, model, parse_hardware("2xRTX3090-24GB", cpu_ram="2TB")) == []
    assert preflight.ram_reasons(_run({"zero_stage": 3}), model, small) == []  # no offload, no check


def test_check_raises_one_message(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(IncompatibleError, match="3 process\\(es\\) were launched") as err:
        preflight.check(_run({"fsdp": "full_shard", "offload": "optimizer"}))
    assert "offload=optimizer+params" in str(err.value) and "\n" not in str(err.value)


def test_train_entry_refuses_before_loading(tmp_path):
    """python -m memfit.train exits 2 with one line, before reading the (absent) weights."""
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"model": "llama-2-7b", "distributed": {"nproc": 2},
                                   "output_dir": str(tmp_path / "out")}))
    p = subprocess.run([sys.executable, "-m", "memfit.train", str(run)], capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "1 process(es) were launched" in p.stderr and "Traceback" not in p.stderr


def test_deepspeed_cpu_adam_must_be_buildable():
    assert preflight.cpu_adam_reason(prebuilt=True, ninja=False, compiler=False) is None
    assert preflight.cpu_adam_reason(prebuilt=False, ninja=True, compiler=True) is None
    msg = preflight.cpu_adam_reason(prebuilt=False, ninja=False, compiler=True)
    assert "missing ninja" in msg and "DS_BUILD_CPU_ADAM=1" in msg and "offload=none" in msg


def test_before_launch_without_torch(tmp_path):
    """memfit launch refuses a bad run in the parent, before starting processes (and without torch)."""
    code = (
        "import sys\n"
        "from memfit.distributed.preflight import before_launch\n"
        "from memfit.spec.run import run_from_dict\n"
        f"r = run_from_dict({{'model': '{tmp_path / 'nope'}', 'strategy': {{'fsdp': 'full_shard', "
        "'offload': 'optimizer'}})\n"
        "print(before_launch(r)); print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    problems, torch_loaded = out.strip().splitlines()
    assert "offload=optimizer+params" in problems and "is not a local model folder" in problems
    assert torch_loaded == "False"
