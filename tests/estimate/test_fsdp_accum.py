"""FSDP with gradient accumulation under ``no_sync`` (``fsdp_sync_each_batch=false``) keeps every unit's whole
gradient between micro-batches (memfit/estimate/peak.py): accelerate's ``no_sync`` (FSDP1
``FullyShardedDataParallel.no_sync``, FSDP2 ``set_requires_gradient_sync(False)``) and Lightning Fabric's
``no_backward_sync``. Hand-computed; measured on 2 gloo processes by bench/studies/fsdp_accum_memory.py
(FSDP1 / FSDP2 full -1.9 / -0.1 %, LoRA -2.5 / -0.2 %)."""

import pytest

from memfit.estimate import estimate
from memfit.spec.hardware import GiB, HardwareSpec, find_gpu
from memfit.spec.model import resolve_model
from memfit.spec.strategy import Strategy


def _grads_line(strategy: Strategy, world: int = 4) -> float:
    hw = HardwareSpec(gpu=find_gpu("A100-80GB"), gpus_per_node=world, cpu_ram_bytes=2048 * GiB)
    return estimate(resolve_model("llama-3.2-1b"), hw, strategy, margin=0.0).gpu["gradients"]


@pytest.mark.parametrize("version", [1, 2])
def test_no_sync_keeps_unsharded_gradients(version):
    """FSDP + accumulation (accelerate's no_sync / Fabric's no_backward_sync): every unit's whole gradient at the
    reduce dtype until the last micro-batch (torch/distributed/fsdp/_runtime_utils.py _post_backward_hook returns
    before the reduce-scatter; _fully_shard/_fsdp_param_group.py post_backward without reduce_grads)."""
    n = float(resolve_model("llama-3.2-1b").parameters)
    base = dict(method="full", fsdp="full_shard", fsdp_version=version, precision="bf16", seq_len=256,
                fsdp_sync_each_batch=False)
    assert _grads_line(Strategy(**base, grad_accum=1)) == pytest.approx(n * 2 / 4)  # bf16 shards
    assert _grads_line(Strategy(**base, grad_accum=4)) == pytest.approx(n * 2)  # whole, bf16
    # fp32 masters: shards of fp32 gradients (n x 4 / 4), but kept unsharded in the bf16 they are reduced in
    mixed = {**base, "precision": "bf16-mixed"}
    assert _grads_line(Strategy(**mixed, grad_accum=4)) == pytest.approx(n * 2)
    # CPU offload: no_sync keeps them on the device ("gradients will not be offloaded to CPU when inside the
    # context manager", FullyShardedDataParallel.no_sync)
    assert _grads_line(Strategy(**base, grad_accum=4, offload="optimizer+params")) == pytest.approx(n * 2)
    # an adapter method keeps only its adapters' gradients whole
    lora = _grads_line(Strategy(**{**base, "method": "lora"}, grad_accum=4))
    assert 0 < lora < n * 2 / 50


def test_no_sync_raises_the_peak_not_the_step():
    hw = HardwareSpec(gpu=find_gpu("A100-80GB"), gpus_per_node=4, cpu_ram_bytes=2048 * GiB)
    model = resolve_model("llama-3.2-1b")
    base = dict(method="full", fsdp="full_shard", fsdp_version=1, precision="bf16", seq_len=256,
                gradient_checkpointing=True, fsdp_sync_each_batch=False)
    one, four = (estimate(model, hw, Strategy(**base, grad_accum=ga), margin=0.0) for ga in (1, 4))
    extra = four.gpu["total"] - one.gpu["total"]
    # at least the unsharded surplus of every gradient but the shards already counted (minus what E/C shared)
    assert extra > 0.5 * float(model.parameters) * 2 * (1 - 1 / 4)


@pytest.mark.parametrize("version", [1, 2])
def test_sync_each_batch_keeps_gradients_sharded(version):
    """memfit's default (accelerate's sync_each_batch, set by memfit's trainer): a reduce-scatter every
    micro-batch, so accumulation holds only the shards; the time model reduces every micro-batch too."""
    n = float(resolve_model("llama-3.2-1b").parameters)
    base = dict(method="full", fsdp="full_shard", fsdp_version=version, precision="bf16", seq_len=256)
    assert Strategy(**base, grad_accum=4).fsdp_sync_each_batch is True
    assert _grads_line(Strategy(**base, grad_accum=4)) == pytest.approx(n * 2 / 4)
    hw = HardwareSpec(gpu=find_gpu("A100-80GB"), gpus_per_node=4, cpu_ram_bytes=2048 * GiB)
    sync, nosync = (estimate(resolve_model("llama-3.2-1b"), hw, Strategy(**base, grad_accum=4, fsdp_sync_each_batch=s),
                             margin=0.0).time for s in (True, False))
    assert sync["comm_seconds"] > nosync["comm_seconds"]  # four reduce-scatters against one


def test_sync_flag_means_something_only_with_fsdp_and_accumulation():
    assert Strategy(fsdp_sync_each_batch=False).fsdp_sync_each_batch is True  # DDP: ignored
    assert Strategy(fsdp="full_shard", fsdp_sync_each_batch=False).fsdp_sync_each_batch is True  # no accumulation
    st = Strategy(fsdp="full_shard", grad_accum=2, fsdp_sync_each_batch=False)
    assert not st.fsdp_sync_each_batch and st.label().endswith("no-sync")
