"""The engines' configs built from a run (pure Python), and DeepSpeed's / accelerate's parsers reading them."""

import subprocess
import sys

import pytest
import yaml

from memfit.distributed.config import accelerate_config, deepspeed_config, fsdp_trainer_config
from memfit.spec.run import run_from_dict


def _run(**strategy):
    return run_from_dict({"model": "llama-2-7b", "strategy": {"micro_batch_size": 2, "grad_accum": 4, **strategy},
                          "distributed": {"nproc": 4, "nodes": 2, "node_rank": 1, "master_addr": "10.0.0.1"}})


def test_zero2_offload_config():
    cfg = deepspeed_config(_run(zero_stage=2, offload="optimizer"), hidden_size=64)
    z = cfg["zero_optimization"]
    assert z["stage"] == 2 and z["reduce_bucket_size"] == 64 * 64
    assert z["offload_optimizer"] == {"device": "cpu", "pin_memory": True} and "offload_param" not in z
    assert cfg["train_batch_size"] == 2 * 4 * 8 and cfg["bf16"]["enabled"] and not cfg["fp16"]["enabled"]
    assert cfg["optimizer"]["type"] == "AdamW"  # DeepSpeed's 32-bit CPU AdamW on GPU
    cpu = deepspeed_config(_run(zero_stage=2, offload="optimizer"), device="cpu")
    assert "optimizer" not in cpu and cpu["zero_force_ds_cpu_optimizer"] is False
    assert cpu["zero_optimization"]["reduce_bucket_size"] == "auto"


def test_zero3_params_offload_gathers_on_save():
    z = deepspeed_config(_run(zero_stage=3, offload="optimizer+params"))["zero_optimization"]
    assert z["offload_param"]["device"] == "cpu" and z["stage3_gather_16bit_weights_on_model_save"]
    assert "allgather_bucket_size" not in z


def test_bucket_sizes_from_run():
    run = run_from_dict({"model": "x", "strategy": {"zero_stage": 1},
                         "distributed": {"reduce_bucket_size": 1000, "allgather_bucket_size": 2000}})
    z = deepspeed_config(run)["zero_optimization"]
    assert (z["reduce_bucket_size"], z["allgather_bucket_size"]) == (1000, 2000)


def test_accelerate_config_multinode_deepspeed():
    cfg = accelerate_config(_run(zero_stage=3), deepspeed_config_file="deepspeed.json")
    assert cfg["distributed_type"] == "DEEPSPEED" and cfg["num_processes"] == 8
    assert cfg["num_machines"] == 2 and cfg["machine_rank"] == 1 and cfg["main_process_ip"] == "10.0.0.1"
    assert cfg["deepspeed_config"] == {"deepspeed_config_file": "deepspeed.json", "zero3_init_flag": True}


@pytest.mark.parametrize("mode, reshard", [("full_shard", True), ("shard_grad_op", False)])
def test_fsdp_configs(mode, reshard):
    run = _run(fsdp=mode, method="qlora", quant_storage="bf16")
    f = fsdp_trainer_config(run)
    assert f["version"] == 2 and f["reshard_after_forward"] is reshard and f["cpu_ram_efficient_loading"]
    a = accelerate_config(run)
    assert a["distributed_type"] == "FSDP" and a["fsdp_config"]["fsdp_reshard_after_forward"] is reshard
    assert a["mixed_precision"] == "bf16"


def test_ddp_cpu_and_errors():
    run = run_from_dict({"model": "x", "strategy": {"precision": "fp32"}, "distributed": {"nproc": 2}})
    assert accelerate_config(run, device="cpu")["distributed_type"] == "MULTI_CPU"
    with pytest.raises(ValueError, match="zero_stage"):
        deepspeed_config(run)


def test_config_module_does_not_import_torch():
    code = "import sys, memfit.distributed.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


ENGINE_CASES = [
    {"zero_stage": 1}, {"zero_stage": 2, "offload": "optimizer"}, {"zero_stage": 3},
    {"zero_stage": 3, "offload": "optimizer+params", "precision": "fp16-mixed"},
    {"fsdp": "full_shard", "offload": "optimizer+params", "method": "qlora", "quant_storage": "bf16"},
    {"fsdp": "shard_grad_op"}, {},
]


@pytest.mark.parametrize("strategy", ENGINE_CASES)
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_engines_accept_what_memfit_writes(strategy, device, tmp_path):
    """DeepSpeed's and accelerate's own parsers (both reject unknown keys) read the emitted configs."""
    pytest.importorskip("deepspeed")
    from accelerate.commands.config.config_args import ClusterConfig
    from deepspeed.runtime.config import DeepSpeedConfig

    run = run_from_dict({"model": "x", "strategy": strategy, "distributed": {"nproc": 1}})
    ds_file = None
    if run.strategy.zero_stage:
        ds = deepspeed_config(run, device=device, hidden_size=512)
        parsed = DeepSpeedConfig(ds)  # world size 1 here: train_batch_size = micro x accumulation
        assert parsed.zero_optimization_stage == run.strategy.zero_stage
        assert parsed.zero_config.gather_16bit_weights_on_model_save == (run.strategy.zero_stage == 3)
        ds_file = str(tmp_path / "deepspeed.json")
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(accelerate_config(run, device=device, deepspeed_config_file=ds_file)))
    cluster = ClusterConfig.from_yaml_file(str(path))
    want = "DEEPSPEED" if run.strategy.zero_stage else "FSDP" if run.strategy.fsdp else "NO"
    assert str(cluster.distributed_type).endswith(want)


@pytest.mark.parametrize("sync", [True, False])
def test_fsdp_trainer_kwargs_carry_sync_each_batch(monkeypatch, tmp_path, sync):
    """memfit's FSDP runs reduce every micro-batch (accelerate's sync_each_batch, which transformers' Trainer reads
    from accelerator_config.gradient_accumulation_kwargs) unless the run asks for the HF Trainer's no_sync.
    (Checked end to end on 2 gloo processes: the Trainer's accelerator held sync_each_batch True / unset.)"""
    from memfit.distributed import engines
    from memfit.distributed.engines import fsdp as fsdp_engine

    monkeypatch.setattr(fsdp_engine, "_sharded_trainer_kwargs",
                        lambda engine, run, out: {"accelerator_config": {"use_configured_state": True}})
    run = _run(fsdp="full_shard", fsdp_sync_each_batch=sync)
    kwargs = engines.for_run(run).trainer_kwargs(run, tmp_path)
    assert kwargs["accelerator_config"] == {"use_configured_state": True,
                                            "gradient_accumulation_kwargs": {"sync_each_batch": sync}}
