"""`plan --emit`: the run file train reads, plus the engine's own config, written atomically."""

import json

import pytest
import yaml

from memfit.errors import MemfitError
from memfit.distributed.emit import emit
from memfit.spec.hardware import parse_hardware
from memfit.spec.run import load_run
from memfit.spec.strategy import Strategy



def test_zero_strategy_writes_run_file_and_deepspeed_json(tmp_path):
    hw = parse_hardware("2x8xV100-32GB", cpu_ram="512GB")
    s = Strategy(method="lora", zero_stage=3, offload="optimizer", gradient_checkpointing=True,
                 precision="fp16-mixed", seq_len=1024, grad_accum=4)
    written = emit(tmp_path / "cfg", s, model_ref="llama-2-7b", hardware=hw, cpu_ram="512GB")
    assert sorted(p.name for p in written) == ["deepspeed.json", "run.yaml"]
    run = load_run(tmp_path / "cfg" / "run.yaml")
    assert run.strategy == s  # the same description flows from plan to train
    assert (run.model, run.hardware, run.cpu_ram) == ("llama-2-7b", "2x8xV100-32GB", "512GB")
    assert (run.distributed.nproc, run.distributed.nodes) == (8, 2)
    ds = json.loads((tmp_path / "cfg" / "deepspeed.json").read_text())
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu" and "offload_param" not in zero
    assert ds["fp16"]["enabled"] and not ds["bf16"]["enabled"]
    assert ds["train_batch_size"] == 1 * 4 * 16
    assert zero["reduce_bucket_size"] == 4096 * 4096  # hidden² from the model
    assert not [p for p in (tmp_path / "cfg").iterdir() if p.name.startswith(".")]  # no temp files left


def test_fsdp_strategy_writes_accelerate_config(tmp_path):
    hw = parse_hardware("2xRTX3090-24GB", cpu_ram="128GB")
    s = Strategy(method="qlora", fsdp="full_shard", offload="optimizer+params", quant_storage="bf16")
    written = emit(tmp_path, s, model_ref="llama-2-70b", hardware=hw)
    assert sorted(p.name for p in written) == ["accelerate.yaml", "run.yaml"]
    acc = yaml.safe_load((tmp_path / "accelerate.yaml").read_text())
    assert acc["distributed_type"] == "FSDP" and acc["num_processes"] == 2
    assert acc["fsdp_config"]["fsdp_offload_params"] is True
    assert acc["fsdp_config"]["fsdp_cpu_ram_efficient_loading"] is True
    assert load_run(tmp_path / "run.yaml").strategy.quant_storage == "bf16"


def test_ddp_strategy_writes_only_the_run_file(tmp_path):
    hw = parse_hardware("1xA100-80GB")
    written = emit(tmp_path, Strategy(method="lora"), model_ref="llama-2-7b", hardware=hw)
    assert [p.name for p in written] == ["run.yaml"]
    assert load_run(written[0]).distributed.nproc == 1


def test_emit_into_a_file_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(MemfitError, match="not a folder"):
        emit(f, Strategy(), model_ref="llama-2-7b", hardware=parse_hardware("1xA100-80GB"))


def test_cpu_pool_emits_one_process_per_device(tmp_path):
    hw = parse_hardware("2xCPU", cpu_ram="16GB")
    written = emit(tmp_path, Strategy(method="lora", zero_stage=2, precision="fp32"),
                   model_ref="llama-2-7b", hardware=hw)
    run = load_run(tmp_path / "run.yaml")
    assert run.distributed.nproc == 2 and run.hardware == "2xCPU"
    ds = json.loads((tmp_path / "deepspeed.json").read_text())
    assert ds["train_batch_size"] == 2 and "offload_optimizer" not in ds["zero_optimization"]
    assert sorted(p.name for p in written) == ["deepspeed.json", "run.yaml"]
