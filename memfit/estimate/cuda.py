"""What a CUDA run holds beyond the tensors autograd and the engines allocate (plain Python, no torch).

- GPU generation from the catalog name (Volta, Turing, Ampere, Ada, Hopper).
- SDPA's backend: flash where it applies, memory-efficient, else the math kernel (full score matrix).
- The caching allocator's reserved peak: allocated + the blocks it keeps cached and cannot reuse.
- CUDA context and NCCL communicator buffers by generation and topology.
- The loading peak of QLoRA on one GPU.
"""

from __future__ import annotations

from typing import NamedTuple

from memfit.estimate.constants import Profile
from memfit.spec.hardware import GpuSpec, HardwareSpec
from memfit.spec.model import ModelSpec

# catalog name prefix -> (generation, compute capability)
_GENERATIONS = (("V100", "volta", 70), ("T4", "turing", 75), ("A100", "ampere", 80), ("A10G", "ampere", 86),
                ("A5000", "ampere", 86), ("A6000", "ampere", 86), ("RTX3090", "ampere", 86), ("L4", "ada", 89),
                ("L40S", "ada", 89), ("RTX4090", "ada", 89), ("H100", "hopper", 90), ("H200", "hopper", 90))


_SEEN: dict = {}


def generation(gpu: GpuSpec) -> tuple[str, int]:
    """(generation, compute capability) of a catalog GPU; unknown names count as Ampere-class if they have
    bf16 (sm80+), else Volta-class."""
    hit = _SEEN.get((gpu.name, gpu.bf16))
    if hit is None:
        hit = next(((gen, cc) for prefix, gen, cc in _GENERATIONS if gpu.name.upper().startswith(prefix)),
                   ("ampere", 80) if gpu.bf16 else ("volta", 70))
        _SEEN[(gpu.name, gpu.bf16)] = hit
    return hit


def sdpa_backend(gpu: GpuSpec, model: ModelSpec, precision: str, attention: str, packed: bool = False) -> str:
    """The kernel torch's SDPA dispatches to for a training step, as memfit's estimate assumes it.

    transformers passes grouped KV heads with ``enable_gqa=True`` only when there is no mask
    (integrations/sdpa_attention.py:42-51, use_gqa_in_sdpa), otherwise it expands k/v first (repeat_kv).
    torch's dispatcher (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp: can_use_flash_attention,
    can_use_mem_efficient_attention) takes flash on sm80+ in 16-bit with head_dim <= 256 and no mask;
    memory-efficient otherwise (fp32 and fp16 before sm80), but it rejects ``enable_gqa``
    (``check_batch_size_and_num_heads_dense<false>``). So ``packed`` batches (no mask) of a grouped-query
    model on pre-Ampere cards or in fp32 fall back to the math kernel, which materialises the scores.
    memfit's trainer pads each batch and passes its attention mask (memfit/train/data.py), so the estimate
    assumes ``packed=False``.
    """
    if attention != "sdpa":
        return "flash_attention_2" if attention == "fa2" else "eager"
    if gpu.is_cpu:
        return "flash (CPU)"
    _, cc = generation(gpu)
    if cc >= 80 and precision != "fp32" and model.head_dim <= 256:
        return "flash"
    if packed and model.kv_heads != model.heads:
        return "math"
    return "memory-efficient"


def attention_for_memory(backend: str, attention: str) -> str:
    """The activation formula's attention kind: the math kernel saves the scores as eager does."""
    return "eager" if backend == "math" else attention


def context_bytes(gpu: GpuSpec, p: Profile) -> float:
    """CUDA context + cuBLAS/cuBLASLt workspaces per process: the context (lazy module loading) plus the
    workspaces, larger on Hopper (torch's default cuBLAS workspace: 32 MiB per handle on sm90 vs 4 MiB
    ×(2 + 8 small) before; cuBLASLt likewise)."""
    if gpu.is_cpu:
        return 0.0
    gen, _ = generation(gpu)
    return p.cuda_context_bytes + (p.cuda_context_hopper_extra_bytes if gen == "hopper" else 0.0)


def nccl_bytes(hardware: HardwareSpec, p: Profile) -> float:
    """NCCL communicator buffers when world > 1: per-channel send/recv buffers (NCCL_BUFFSIZE 4 MiB x
    protocols) over the channels NCCL opens, many on NVLink (and NVLS on Hopper), few over PCIe."""
    gpu = hardware.gpu
    if gpu.is_cpu or hardware.world_size <= 1:
        return 0.0
    nvlink = gpu.intra_node_bandwidth >= 100e9
    extra = p.nccl_nvls_bytes if (nvlink and generation(gpu)[0] == "hopper" and hardware.gpus_per_node > 2) else 0.0
    return (p.nccl_buffer_bytes if nvlink else p.nccl_buffer_pcie_bytes) + extra


class Gap(NamedTuple):
    """Reserved − allocated at the peak, by what a failed ``cudaMalloc`` can give back (``reserved_gap``)."""
    split: float    # block splitting's and rounding's waste inside segments in use: never released
    pinned: float   # cached blocks in segments that also hold live tensors: released only with their segment
    whole: float    # cached segments with nothing live in them: freed on a failed cudaMalloc, then retried

    @property
    def total(self) -> float:
        return self.split + self.pinned + self.whole

    @property
    def firm(self) -> float:
        """What the card must hold beyond the allocated bytes: the gap less the segments the allocator frees."""
        return self.split + self.pinned


def reserved_gap(allocated: float, layer_working_set: float, loss_blocks: float, offload: bool, p: Profile,
                 expandable: bool = False) -> float:
    """Reserved − allocated at the peak (``gap_parts``' total)."""
    return gap_parts(allocated, layer_working_set, loss_blocks, offload, p, expandable=expandable).total


def gap_parts(allocated: float, layer_working_set: float, loss_blocks: float, offload: bool, p: Profile,
              step_is_peak: bool = False, expandable: bool = False) -> Gap:
    """Reserved − allocated at the peak, split by what the allocator can give back when the card is full.

    The caching allocator keeps every freed block: a layer's forward and backward temporaries (with
    checkpointing its recomputation's) are freed into blocks that the loss's and the step's differently sized
    tensors do not fit, which get fresh segments: ``allocator_cached_layers`` x that working set.
    ``loss_blocks``: the loss's logits-sized blocks when the optimizer step is the peak; freed before it,
    ``allocator_cached_loss`` of them stay reserved beside the gradients and step temporaries (measured on an
    H200 with checkpointing: full fine-tuning of 1B/3B reserved the whole logits line on top of the step's peak).
    On top, block splitting and rounding waste ``fragmentation`` of the allocated bytes, and offload's side
    streams keep their own pools.

    What a failed ``cudaMalloc`` gets back (torch 2.13 ``c10/cuda/CUDACachingAllocator.cpp``): ``malloc``
    retries after ``release_available_cached_blocks`` and ``release_cached_blocks``, and both free only
    *unsplit* blocks (``release_blocks``: "Frees all non-split blocks", ``if (!block->prev && !block->next)``;
    ``release_available_cached_blocks`` returns at once while ``max_split_size`` is unlimited, the default). A
    block is split whenever the remainder exceeds 1 MiB in the large pool (``should_split``), and a freed block
    merges only with free neighbours (``free_block``). So:

    - at a peak inside the forward or backward, a layer's working set is freed into segments that the tensors
      allocated after it (the next layer's input kept by checkpointing, the gradients) are carved from by best
      fit: split segments with live blocks, which no retry releases (``pinned``);
    - at the optimizer step's peak (``step_is_peak``) every activation is freed, and what the step allocates
      (its temporaries; the optimizer's states at the first step) is carved from those blocks by the same best
      fit: what stays cached there is released or reused, not held (``whole``) — fms-acceleration's Mistral-7B
      full fine-tune at micro-batch 8 (a step peak) measured 76.5 GB ``nvidia-smi`` on 85 GB, 4 GB under its
      batch-4 twin;
    - the loss's logits-sized tensors (each above ``kMinLargeAlloc``, 10 MiB: a ``cudaMalloc`` of its own size
      rounded to 2 MiB) are segments of their own, wholly free after the loss's backward: released (``whole``);
    - block splitting's waste sits in segments in use (``split``).

    ``expandable`` (the strategy's ``allocator: expandable_segments``, ``PYTORCH_CUDA_ALLOC_CONF=
    expandable_segments:True``; the same file's Note [Expandable Segments]): one segment per stream grows by
    20 MiB pages (2 MiB in the small pool) and new blocks tile into it by the same best fit, so the slivers a
    larger batch leaves at the ends of per-tensor segments are not made; on a failed allocation
    ``release_blocks`` unmaps every free page of it, split or not (``unmap_block``). So the cached terms go
    (torchtune #1185: 16.39 -> 10.83 GiB reserved with checkpointing; memfit's H200 check measured no change
    without checkpointing) and only the splitting waste inside pages in use stays."""
    frac = p.fragmentation + (p.fragmentation_offload if offload else 0.0)
    if expandable:
        return Gap(frac * allocated, 0.0, 0.0)
    layers, loss = p.allocator_cached_layers * layer_working_set, p.allocator_cached_loss * loss_blocks
    return Gap(frac * allocated, 0.0, layers + loss) if step_is_peak else Gap(frac * allocated, layers, loss)


def cap_cached(gap: Gap, allocated: float, fixed: float, capacity: float) -> float:
    """The reserved − allocated gap a card of ``capacity`` shows: what cannot be released in full, the whole
    free segments only up to what the card leaves beside it (the allocator frees them and retries when the
    device runs out, paying the retries' synchronising frees in time)."""
    room = capacity - allocated - gap.firm - fixed
    return gap.firm + min(gap.whole, max(room, 0.0))


def qlora_loading_peak(model: ModelSpec, quantized: bool, sharded: bool, quant_state: float, nums, half: float,
                       p: Profile) -> float:
    """GPU bytes while loading QLoRA's base on one GPU (0 where loading holds no more than training).

    bitsandbytes quantises each 16-bit checkpoint tensor as it reaches the GPU (Params4bit.to(cuda)), so
    loading holds the whole quantised model plus one 16-bit tensor being quantised; then
    prepare_model_for_kbit_training upcasts the non-quantised parameters to fp32 one at a time
    (peft/utils/other.py:205-209: the old 16-bit copy is freed after each). Under zero.Init DeepSpeed
    partitions while loading. Under FSDP it depends on where the loading path leaves the quantised model
    before ``fully_shard``: accelerate/utils/fsdp_utils.py:790-797 warns of a "VRAM spike" when Params4bit
    already sit on a GPU. Not modelled there (unmeasured)."""
    if not quantized or sharded:
        return 0.0
    other = model.parameters - nums.linear_params
    biggest = max(nums.largest_linear, model.embedding_parameters) * half
    upcast = max(model.embedding_parameters, model.head_parameters) * 4.0
    return nums.linear_params * p.nf4_bytes_per_param + quant_state + other * half + max(biggest, upcast)
