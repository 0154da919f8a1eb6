"""FSDP CPU offload's pinned host blocks (memfit.estimate.pinned): torch's pinned allocator rounds every block up
to a power of two; FSDP1 pins a shard and a same-size gradient buffer per unit, frozen units included."""

from types import SimpleNamespace

import pytest

from memfit.estimate import estimate
from memfit.estimate.pinned import fsdp_offload, pinned_block
from memfit.spec.hardware import parse_hardware
from memfit.spec.model import resolve_model
from memfit.spec.strategy import Strategy


def test_pinned_blocks_round_up_to_a_power_of_two():
    assert pinned_block(4096) == 4096
    assert pinned_block(4097) == 8192
    assert pinned_block(214e6) == 2 ** 28  # a 70B NF4 layer's shard on 2 ranks: 214 MB -> 268 MB
    assert pinned_block(143e6) == 2 ** 28  # on 3 ranks: 143 MB -> 268 MB as well
    assert pinned_block(0) == 0


def test_fsdp1_pins_each_unit_and_its_gradient_buffer():
    model = SimpleNamespace(layers=2)
    run = SimpleNamespace(model=model, world=2, fsdp_version=1)
    params, grads = fsdp_offload(run, layers_bytes=2 * 300e6, root_bytes=100e6, trained_bytes=0.0)
    # two layer shards of 150 MB -> 2^28 each, the root's 50 MB -> 2^26; _cpu_grad the same, frozen or not
    assert params == 2 * 2 ** 28 + 2 ** 26
    assert grads == params


def test_seed_004_shape_a_third_gpu_needs_less_cpu_ram():
    """70B FSDP1 + QLoRA: on 2 x 24 GB it needs CPU offload, and the offloaded shards' pinned blocks + FSDP1's
    gradient buffers make the node's RAM the largest; on 3 GPUs it fits without offload and needs less."""
    m = resolve_model("llama-2-70b")
    base = dict(method="qlora", fsdp="full_shard", fsdp_version=1, gradient_checkpointing=True, seq_len=2048,
                micro_batch_size=1, quant_storage="bf16")  # Answer.AI: NF4 packed in bf16 elements
    two = estimate(m, parse_hardware("2xRTX3090-24GB"), Strategy(**base, offload="optimizer+params"))
    three = estimate(m, parse_hardware("3xRTX3090-24GB"), Strategy(**base))
    assert two.fits and three.fits
    assert two.cpu["total"] > 1.5 * three.cpu["total"]
    # the offloaded parameter shards: 80 layer units + the root per rank, each rounded up, twice (shard + grad)
    assert two.cpu["offloaded_params"] == pytest.approx(two.cpu["offloaded_gradients"])
