"""The engines' cost records (memfit.engines): one per engine that runs, each answering what the pricing code asks."""

import subprocess
import sys

from memfit.distributed.engines import ENGINES
from memfit.engines import ENGINE_COSTS, engine_cost
from memfit.spec.strategy import Strategy


def test_one_record_per_engine_that_runs():
    assert set(ENGINE_COSTS) == set(ENGINES)
    assert all(name == cost.name for name, cost in ENGINE_COSTS.items())


def test_what_each_engine_shards():
    sharded = {name: (c.shards_optimizer, c.shards_gradients, c.shards_parameters)
               for name, c in ENGINE_COSTS.items()}
    assert sharded == {"ddp": (False, False, False), "zero1": (True, False, False), "zero2": (True, True, False),
                       "zero3": (True, True, True), "fsdp-full_shard": (True, True, True),
                       "fsdp1-full_shard": (True, True, True), "fsdp-shard_grad_op": (True, True, False),
                       "fsdp1-shard_grad_op": (True, True, False)}
    assert [n for n, c in ENGINE_COSTS.items() if c.keeps_unsharded_params] == ["fsdp-shard_grad_op",
                                                                                 "fsdp1-shard_grad_op"]


def test_the_fsdp_version_follows_the_strategy():
    for version in (1, 2):
        for mode in ("full_shard", "shard_grad_op"):
            st = Strategy(method="lora", fsdp=mode, fsdp_version=version)
            assert ENGINE_COSTS[st.engine].fsdp_version == version
    assert ENGINE_COSTS[Strategy(method="lora", zero_stage=3).engine].fsdp_version == 0


def test_deepspeed_zero3_alone_recomputes_the_chunked_head_and_keeps_a_flat_gradient_buffer():
    for fact in ("loss_recomputes_head", "flat_grad_buffer", "partitioned_loading", "regathers_in_recompute",
                 "module_fetch_hooks", "fp32_params_are_master"):
        assert [n for n, c in ENGINE_COSTS.items() if getattr(c, fact)] == ["zero3"], fact


def test_the_kinds_the_step_passes():
    assert engine_cost("zero3") is ENGINE_COSTS["zero3"]
    assert engine_cost("zero3", fsdp=True).unit_hooks and not engine_cost("zero3", fsdp=True).regathers_in_recompute
    assert engine_cost("sgo").keeps_unsharded_params and engine_cost("sgo", fsdp=True).weight_gathers == 1
    assert engine_cost("fsdp").unit_hooks and engine_cost("zero1", fsdp=True) is ENGINE_COSTS["zero1"]
    assert engine_cost(ENGINE_COSTS["ddp"]) is ENGINE_COSTS["ddp"]


def test_the_registry_imports_no_torch():
    code = "import sys, memfit.engines; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
