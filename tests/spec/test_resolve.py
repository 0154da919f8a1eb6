"""resolve(run): one reading of a run's model, pool (hardware × nproc × nodes), strategy and world size."""

import dataclasses

import pytest

from memfit.errors import ConfigError
from memfit.estimate import estimate
from memfit.resolve import resolve
from memfit.spec.hardware import parse_hardware
from memfit.spec.model import resolve_model
from memfit.spec.run import run_from_dict


def _run(**extra):
    return run_from_dict({"model": "llama-2-7b", **extra})


def test_local_pool_has_one_device_per_process():
    r = resolve(_run(distributed={"nproc": 2}, strategy={"zero_stage": 3, "method": "full"}))
    local = parse_hardware("local")
    assert (r.hardware.gpus_per_node, r.hardware.nodes, r.world) == (2, 1, 2)
    assert r.hardware.gpu == local.gpu and r.strategy.zero_stage == 3
    assert r.model == resolve_model("llama-2-7b")


def test_catalog_pool_follows_the_launched_layout():
    r = resolve(_run(hardware="8xA100-80GB", distributed={"nproc": 4, "nodes": 2}))
    assert (r.hardware.gpus_per_node, r.hardware.nodes, r.world) == (4, 2, 8)
    assert r.hardware.gpu.name == "A100-80GB"
    # the assumed CPU RAM is the catalog default for 4 GPUs, unless cpu_ram is given
    assert r.hardware.cpu_ram_bytes == parse_hardware("4xA100-80GB").cpu_ram_bytes
    given = resolve(_run(hardware="8xA100-80GB", cpu_ram="100GB", distributed={"nproc": 4}))
    assert given.hardware.cpu_ram_bytes == 100 * 10**9
    same = resolve(_run(hardware="8xA100-80GB", distributed={"nproc": 8}))
    assert same.hardware == parse_hardware("8xA100-80GB")


def test_unreadable_model_is_a_config_error():
    with pytest.raises(ConfigError):
        resolve(_run(model="no-such-model-anywhere"))


def test_train_summary_predicts_the_two_process_zero3_run():
    """The train summary's prediction is the per-rank estimate at world size 2, not one process's."""
    from memfit.train.api import predict

    run = _run(distributed={"nproc": 2}, strategy={"zero_stage": 3, "method": "full", "precision": "fp32"})
    two = dataclasses.replace(parse_hardware("local", cpu_ram=run.cpu_ram), gpus_per_node=2)
    want = estimate(resolve_model("llama-2-7b"), two, run.strategy).to_dict()
    got = predict(run)
    assert got["memory"]["gpu_bytes"]["total"] == want["memory"]["gpu_bytes"]["total"]
    one = estimate(resolve_model("llama-2-7b"), parse_hardware("local"), run.strategy).to_dict()
    # ZeRO-3 over 2 ranks: each rank holds half the parameters, gradients and Adam states
    assert got["memory"]["gpu_bytes"]["total"] < 0.6 * one["memory"]["gpu_bytes"]["total"]
