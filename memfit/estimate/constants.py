"""Profile: every free constant of the estimator in one place, so measurement can calibrate it.

All values are plain floats (flags are 0.0/1.0) with a one-line comment giving what and where from.
``Profile.load(path)`` / ``.save(path)`` use JSON: the fields at top level, plus ``calibrated``
(field name → relative error measured after fitting) and free-form ``notes``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from memfit.errors import ConfigError

GiB = float(1 << 30)
# constants older profiles may still carry, no longer read (replaced by the named physics)
RETIRED = frozenset({"optimizer_step_temp_bytes_gpu",  # -> adamw_foreach_temp_copies
                     # GPU time as one utilisation (-> the parts of memfit.steptime)
                     "utilization", "utilization_half_tokens", "qlora_dequant_slowdown", "gpu_optimizer_seconds_per_param",
                     "utilization_attention_fused", "memory_bandwidth_efficiency", "default_memory_bandwidth",
                     "kernel_launch_seconds", "cpu_adam_params_per_second"})
# switches older profiles may carry that became strategy keys (#39: strategy.allocator), ignored with a note
MOVED_TO_STRATEGY = {"expandable_segments": "allocator: expandable_segments"}


@dataclass(frozen=True)
class Profile:
    # ---- time: compute ----------------------------------------------------------------------------
    utilization_fp32: float = 0.6  # achieved fraction of plain fp32 FLOP/s (no tensor cores; simpler kernels)
    utilization_cpu: float = 0.25  # CPU pseudo-device: fraction of the core-count FLOP/s estimate (tiny-Llama steps on a shared 2-core machine: 0.15–0.4)
    eager_attention_slowdown: float = 1.5  # uncalibrated CPU: eager attention (materialised s²) runs its FLOPs this much slower than fused kernels (guess)
    # ---- time: the uncalibrated CPU pseudo-device (docs/time.md) ------------------------------------------
    gemm_small_fraction: float = 0.5  # a linear of width gemm_small_width runs at this fraction of a large one (guess, `memfit calibrate --hardware` measures it)
    gemm_skinny_fraction: float = 0.1  # LoRA's rank-r products against a large linear's rate (roofline: ~2r FLOP per value read)
    gemm_small_width: float = 512.0  # width sqrt(k·n) of a "small" linear (as calibrated)
    gemm_large_width: float = 4096.0  # width of a "large" linear
    # ---- time: catalog GPUs, from parts (memfit.steptime; each part's source in its module, docs/gpu-time.md) ----
    gemm_max_fraction: float = 0.9  # fitted on the public GPU throughputs (bench/gpu_time_fit.py; the grid's upper bound, the best published fraction ~0.87-0.9); prior 0.8: best achievable bf16 GEMM / dense peak where memfit.steptime.devices has no published figure (A100 0.87, H100 0.80: stas00/ml-engineering "maximum achievable matmul FLOPS")
    matmul_sustained_fraction: float = 0.85  # fitted (bench/gpu_time_fit.py): the share of a kind's published best achievable matmul rate (memfit.steptime.devices: A100 0.87, H100 0.80 of peak, a hot GEMM of ideal shape) its GEMMs sustain inside a training step; one factor for every published kind, judged leave-one-group-out on four A100/H100 groups (a development figure: bench/provenance.json)
    gemm_kernel_seconds: float = 5e-6  # a GEMM's fixed device time: XLA's measured H100 table (matmul_interpolator_data.h) 256x2048x256 6.4 us, 512x256x256 5.8 us
    gemm_small_tile_efficiency: float = 0.8  # a 64x128 cuBLAS tile's rate against a 128x128 one: puts XLA's H100 1024x1024x2048 at 357 TFLOP/s (measured 350; tests/steptime/test_steptime.py)
    bandwidth_max_fraction: float = 0.9  # elementwise kernels' achieved share of HBM bandwidth at >= 100 MB (Calculon systems/a100_80g.json: 0.90)
    bandwidth_half_bytes: float = 2.5e5  # fitted (bench/gpu_time_fit.py; Calculon's bins put it near 2e6 on A100: the public rows favour smaller); prior 2e6: transfer size at half of that (Calculon's A100 bins: >= 10 MB 0.75, >= 1 MB 0.60, below 0.30)
    attention_max_fraction: float = 0.6  # FlashAttention-2 forward + backward at long sequences / dense peak, Ampere and Ada (FA2 paper arXiv 2307.08691 Fig. 6: ~180-190 TFLOP/s of A100's 312)
    attention_half_seq: float = 400.0  # sequence length at which FA2 reaches half of that (the same curve: ~100 TFLOP/s at 512, ~130 at 1k, ~155 at 2k)
    attention_forward_share: float = 0.25  # the forward's share of fused attention's forward + backward time (recomputed under checkpointing): memfit's H200 calibration read 0.247-0.259 (bench/results)
    mem_efficient_attention_fraction: float = 0.5  # SDPA's memory-efficient kernel (pre-Ampere parts) against FA2 (FA2 paper Fig. 4-6: xformers' cutlass kernel at ~half FA2's rate)
    eager_score_bytes: float = 88.0  # eager attention's bytes per score, forward + backward (scale, mask, fp32 softmax, cast, gradients): memfit's H200 calibration, 2.07-2.13e-11 s per score at 4.15-4.24 TB/s
    gpu_host_op_seconds: float = 5.5e-5  # measured, not fitted: host: one module-level op forward + backward in PyTorch eager on a GPU host; memfit's four H200 calibrations (memfit.measure.overheads.model_overheads, a Llama decoder layer of 49 ops at width 16 under bf16 autocast: 1.88, 2.54, 2.90, 3.01 ms, bench/results/gpu_*time_check_h200*.json) read 38, 52, 59, 61 us per op, median 55 us, on a virtualised host (bare-metal hosts faster)
    gc_host_fraction: float = 1.2  # host work of a checkpointed decoder layer's recompute (non-reentrant torch.utils.checkpoint: its pack / unpack hooks, the recomputed forward, the early stop) as a fraction of the layer's forward + backward dispatch: memfit's H200 calibrations (memfit.measure.overheads.model_overheads, width 16: compute nil) read 1.07, 1.18, 1.21, 1.26 (bench/results/gpu_*time_check_h200*.json); this CPU 1.7-2.1
    qlora_call_ops: float = 12.0  # host ops per Linear4bit call forward + input gradient (bitsandbytes matmul_4bit: quant-state checks, dequantize_4bit, linear, casts; H200 calibration 0.45-0.70 ms per call at 38-61 us per op)
    fsdp_unit_ops: float = 40.0  # host ops per FSDP unit per micro-batch: pre/post forward and backward hooks (unshard, reshard, stream waits, reduce-scatter launch and copies; torch/distributed/fsdp/_runtime_utils.py)
    zero3_module_ops: float = 8.0  # host ops per submodule per pass under DeepSpeed ZeRO-3 (partitioned_param_coordinator fetch_sub_module / release_sub_module hooks, trace bookkeeping)
    adam_bytes_per_param: float = 80.0  # torch AdamW foreach step, bytes per fp32 parameter (scaled at use by the run's trainable dtype: memfit.estimate.setup optimizer_dtypes): torch/optim/adam.py _multi_tensor_adam passes: weight decay mul_ 8, lerp_ 12, mul_ 8, addcmul_ 12, sqrt 8, div_ 8, add_ 8, addcdiv_ 16
    adam_bandwidth_fraction: float = 0.5  # the foreach kernels' achieved share of HBM bandwidth, measured: memfit's H200 calibration 3.1-3.5e-11 s per fp32 parameter = 0.48-0.55 of 4.8 TB/s (bench/results); not fitted (PEFT's full fine-tune of Llama-3.2-3B on an L40S, pure bf16, 0.36 s steps, would need >= 0.6 of 864 GB/s: docs/gpu-time.md)
    collective_latency_seconds: float = 3e-5  # NCCL all-reduce latency of a small message within a node (nccl-tests: 10-50 us)
    cpu_bandwidth: float = 10e9  # uncalibrated CPU pseudo-device: bytes/s of elementwise work (order of magnitude)
    cpu_op_seconds: float = 1.2e-5  # uncalibrated CPU: one small op forward + backward (this project's 2-core machine: 12 us, memfit calibrate --hardware)
    trainer_step_collectives: float = 4.0  # the HF Trainer's own collectives per optimizer step with several processes and logging every step (transformers 5.24 trainer.py: num_items_in_batch and num_input_tokens_seen gathers, the logged loss's nested_gather and store_flos; counted on a 2-rank gloo run: 37 calls in 9 steps)
    # the HF Trainer's own loop, in small-op costs (bench/trainer_overhead.py: memfit's trainer against the bare loop on a
    # width-16 Llama, 3 repetitions; 2026-12-01 on this machine, op 10.3-10.6 us): full fine-tuning 61 ops at 1 micro-batch,
    # 138 at 4 and 52 with 6 layers instead of 2; LoRA 117 (4 adapters), 184 (14), 383 (42) and 478 (14, 4 micro-batches)
    trainer_step_ops: float = 35.0  # per optimizer step: callbacks, accelerate's optimizer / scheduler wrappers, clipping's plumbing
    trainer_micro_batch_ops: float = 26.0  # per micro-batch: training_step's Python, the loss check, the FLOP count (trainer.py floating_point_ops)
    trainer_peft_ops: float = 30.0  # per optimizer step with a PEFT model (its wrappers)
    trainer_adapter_step_ops: float = 1.7  # per adapted linear and optimizer step
    trainer_adapter_micro_batch_ops: float = 5.2  # per adapted linear and micro-batch
    # the loop around the step (after on_step_end, before the next on_step_begin), logging every step: the logged loss
    # and grad norm's .item(), the log callbacks, store_flos; get_batch_samples fetching, collating and counting the next
    # step's batches (bench/trainer_overhead.py "outside", measured within the same process: 80-97 ops at 1 micro-batch,
    # 151-205 at 4, 2026-12-01 on this machine, op 7.1-7.8 us)
    trainer_outside_step_ops: float = 58.0  # per optimizer step
    trainer_outside_micro_batch_ops: float = 29.0  # per micro-batch
    overlap_cpu_comm: float = 0.0  # CPU processes: gloo's collectives share the cores with compute (none hidden)
    # the sharded engines' host work on a CPU (memfit.steptime.engine_host; counted / measured on 2-rank gloo runs
    # of a 39-tensor h-256 Llama, docs/time.md "Sharded engines on a CPU"), in small-op costs (op_seconds)
    deepspeed_grad_ops: float = 30.0  # DeepSpeed 0.19.8 ZeRO-1/2 host work per gradient per reduction (stage_1_and_2.py gradient hook -> reduce_ipg_grads -> average_tensor: IPG bucket copy, post-scale, all_reduce launch, copy back, partition copy; 14.3 aten ops counted): 17-30 ms main-thread CPU per step over 39 gradients less ~7.4 ms of copies, op_seconds 10.4 us beside it
    deepspeed_step_ops: float = 35.0  # DeepSpeed ZeRO-1/2 step's host work per gradient (get_grad_norm_direct, the flat partition's bookkeeping, timers, memory reports; 9.6 aten ops counted): 21-26 ms CPU less its flat AdamW (~5 ms) and ~2.6 ms of copies, over 39 gradients at op_seconds 10.4 us
    fsdp2_ops_per_param: float = 83.0  # FSDP2 (torch 2.13 _fully_shard) hooks' Python per parameter per micro-batch (unshard/reshard bookkeeping, a DTensor per sharded gradient): 39-48 ms main-thread CPU per step over 39 parameters, ~9.5 ms of it the copies, with op_seconds measured beside it at 10.6 us
    adamw_ops_per_tensor: float = 9.4  # torch.optim.AdamW (single-tensor, 2.13 adam.py _single_tensor_adam) ops per parameter per step: 367 over 39, counted likewise
    dtensor_op_extra: float = 4.0  # DTensor's dispatch per op beyond a plain tensor's, in small-op costs: AdamW.step over 39 FSDP2 shards (1.7 M elements) 17-26 ms vs 10.2 ms over 39 whole tensors (3.4 M) in the same window, op_seconds 10.6 us
    # ---- time: communication ------------------------------------------------------------------------
    shm_bus_fraction: float = 0.31  # GPUs without peer-to-peer (GeForce without NVLink): NCCL's SHM transport stages every byte through host memory; its bus bandwidth as a share of the PCIe link, one direction (nccl-tests#74: P2P-disabled bidirectional copies 19-21 GB/s on PCIe 4.0 x16, ~10 GB/s each way = 0.31 of 32 GB/s)
    intra_node_efficiency: float = 0.7  # achieved fraction of NVLink/PCIe bandwidth for NCCL ring collectives (nccl-tests busbw)
    inter_node_efficiency: float = 0.8  # achieved fraction of the node's network bandwidth
    pcie_efficiency: float = 0.75  # achieved fraction of PCIe bandwidth for pinned host<->device copies
    overlap_ddp: float = 0.65  # GPUs: share of the micro-batches' device time DDP's bucketed all-reduce runs behind (the backward: ~2/3 of forward + backward FLOPs)
    overlap_zero12: float = 0.65  # GPUs: likewise for ZeRO-1/2 / shard_grad_op (reductions during the backward, overlap_comm)
    overlap_zero3: float = 0.9  # GPUs: likewise for ZeRO-3 / FSDP full_shard (gathers prefetched during forward and backward)
    comm_overlap_tax: float = 0.25  # GPUs: a collective hidden behind compute still costs this share of its time: NCCL runs each channel as a thread block on the SMs (16-32 channels on NVLink parts, nccl src/graph/search.cc) beside the kernels, ~15-30 % of an A100's 108 SMs, and shares HBM bandwidth
    overlap_offload: float = 0.3  # fraction of offload PCIe traffic hidden behind compute
    cpu_adam_params_per_second_node: float = 1e9  # offloaded AdamW's parameters per second per node, shared by its processes (DeepSpeedCPUAdam, AVX-512, all cores: ZeRO-Offload paper arXiv 2101.06840 Table 4, 1.5-2.4e9/s on a DGX-2 host's 2x24 cores; cloud hosts with fewer cores per GPU less)
    meft_overlap: float = 0.5  # fraction of MEFT's PCIe traffic hidden by look-ahead prefetch (meft.md)
    meft_cpu_flops: float = 5e10  # CPU FLOP/s per process for MEFT's key-expert search and scatter (guess; calibrate)
    # ---- GPU memory: activations ---------------------------------------------------------------------
    activation_scale: float = 1.0  # multiplier on the derived per-layer activation bytes (calibration knob)
    activation_korthikanti: float = 0.0  # 1.0 = use the GPT-style s·b·h·(34 + 5as/h) count instead of the derived one
    logits_bytes_16bit: float = 12.0  # bytes per logit at the loss peak: fp32 log-softmax 4 + two fp32 grads 8 (the trainer drops the half logits before backward)
    logits_bytes_fp32: float = 12.0  # fp32 training: log-softmax 4 + two grads 8 (bench/estimate_vs_probe.py, tiny Llama on CPU)
    chunked_logits_bytes: float = 8.0  # loss=chunked, fused path: per logit of one chunk, its fp32 logits (softmax and gradient made in place) + logsumexp's temporary (bench/chunked_loss.py)
    logits_live_during_recompute: float = 0.0  # with checkpointing: fraction of the logits line still live while the last layer recomputes (traced: none, the loss's backward has run)
    optimizer_step_temp_bytes: float = 2.5  # CPU device: temporaries per locally-updated trainable param in the step (foreach AdamW, measured ~2.6)
    adamw_foreach_temp_copies: float = 1.0  # GPUs: torch AdamW's foreach step (memfit's trainer asks for "adamw_torch"; the HF Trainer's default before torch 2.8) allocates exp_avg_sq_sqrt, one state-sized tensor per param (torch/optim/adam.py:762); fused AdamW: 0
    zero_fp32_grad_bytes: float = 4.0  # DeepSpeed 16-bit training: fp32 copy of the local gradient partition for the step
    checkpoint_extra_layers: float = 1.0  # layers whose full working set is live during recomputation with checkpointing
    # ---- GPU memory: overheads ------------------------------------------------------------------------
    cuda_context_bytes: float = 0.8 * GiB  # CUDA context + cuBLAS/cuDNN workspaces per process (0.5–2 GiB; 0 on CPU)
    cuda_context_hopper_extra_bytes: float = 0.1 * GiB  # Hopper: larger cuBLAS/cuBLASLt workspaces (32 MiB per handle and stream) and kernels (cuda-memory.md)
    nccl_buffer_bytes: float = 0.5 * GiB  # NCCL communicator buffers when world > 1 over NVLink (many channels) (memory-model.md: 1–2 GiB incl. streams)
    nccl_buffer_pcie_bytes: float = 0.2 * GiB  # NCCL buffers over PCIe without P2P (few channels; cuda-memory.md: small)
    nccl_nvls_bytes: float = 1.0 * GiB  # NVLink SHARP (NVLS) buffers on Hopper NVSwitch nodes (> 2 GPUs) (cuda-memory.md: ~1 GB)
    fragmentation: float = 0.04  # caching allocator: reserved − allocated from block splitting/rounding, as a fraction of the allocated peak (fitted on published runs and the H200 gpu-check: bench/gpu_published.py)
    allocator_cached_layers: float = 0.75  # layer working sets the caching allocator keeps cached but cannot reuse for the loss/step's larger blocks (fitted on published runs and the H200 gpu-check: bench/gpu_published.py)
    allocator_cached_loss: float = 0.75  # fraction of the loss's logits-sized blocks still reserved when the optimizer step is the peak (fitted on every group of published runs + the H200 gpu-check, as the two above: bench/gpu_published.py; was 0.5, moved off the fit for one fms-acceleration row)
    fragmentation_offload: float = 0.0  # + fraction of allocated with offload (side streams keep their own pools; GMLake: up to ~33 %)
    # CPU pseudo-device: glibc malloc (as `memfit train` runs it: no MALLOC_* settings) serves tensors under its mmap
    # threshold (dynamic, up to 32 MiB: malloc/malloc.c DEFAULT_MMAP_THRESHOLD_MAX) from the brk heap, which shrinks
    # only from its top: the holes freed tensors leave stay resident, so peak RSS = baseline + tensor peak + these.
    # They follow what a micro-batch allocates layer by layer, not the peak: A = all layers' activations of one
    # micro-batch without checkpointing (with it, the same tensors made in the forward and the recomputation).
    # Measured with bench/rss_breakdown.py (fp32, seq 512, h256/4-layer Llama, 7 configurations): peak RSS under
    # glibc's defaults - (baseline + tensor peak, which the same runs read within +3-4 % with
    # MALLOC_MMAP_THRESHOLD_=65536, every freed tensor unmapped) = 30 MB + 0.48-0.62 x A training the base
    # (full: mb 2/4/8, eager/SDPA, checkpointing) and 0.65-0.91 x A with adapters (LoRA: mb 1/4, eager/SDPA).
    fragmentation_cpu: float = 0.62  # glibc heap kept beyond the tensor peak, per byte of A, base weights trained (bench/rss_breakdown.py: 0.48-0.62)
    fragmentation_cpu_adapters: float = 0.92  # the same with a frozen base and adapters (LoRA; QLoRA/DoRA/MEFT unmeasured) (bench/rss_breakdown.py: 0.65-0.91)
    fragmentation_cpu_bytes: float = 30e6  # + bytes per process whatever A (bench/rss_breakdown.py: LoRA mb 1 + checkpointing keeps 72 MB with A = 65 MB)
    ddp_bucket_copy: float = 1.0  # DDP keeps flat gradient buckets: a second copy of trainable grads (gradient_as_bucket_view=False)
    zero_reduce_bucket_per_h2: float = 1.0  # DeepSpeed reduce_bucket_size = h² elements (HF 'auto'); double-buffered
    zero_allgather_bucket_elements: float = 2e8  # ZeRO-1/2 allgather_bucket_size (elements) that memfit writes into its DeepSpeed config when the run sets none (memfit/distributed/config.py); not DeepSpeed's own default, which is 5e8 (deepspeed 0.19.8 runtime/zero/config.py:132): a hand-written config without the key holds 5e8 (pass distributed.allgather_bucket_size)
    zero_overlap_comm: float = 1.0  # DeepSpeed overlap_comm (memfit's config on CUDA): a second reduce bucket (stage_1_and_2.py:3273)
    zero3_prefetch_per_h2: float = 0.9  # stage3_prefetch_bucket_size = 0.9·h² elements (HF 'auto')
    gathered_layers: float = 2.0  # FSDP full_shard: wrapped decoder layers gathered at once (current + prefetched)
    zero3_max_live_parameters: float = 1e9  # DeepSpeed stage3_max_live_parameters (default) caps gathered elements
    zero3_max_reuse_distance: float = 1e9  # DeepSpeed stage3_max_reuse_distance (default): params reused within it stay gathered (CPU gloo run)
    # ---- frozen weights -----------------------------------------------------------------------------
    nf4_bytes_per_param: float = 0.5  # 4-bit NF4 codes
    nf4_absmax_bytes: float = 0.0625  # one fp32 absmax per 64-value block
    nf4_absmax_bytes_double_quant: float = 0.0159  # 8-bit absmax per block + fp32 per 256 blocks (QLoRA paper)
    qlora_fp32_upcast: float = 1.0  # 1.0: prepare_model_for_kbit_training upcasts non-quantised params (embeddings, head, norms) to fp32
    # ---- MEFT -------------------------------------------------------------------------------------
    meft_live_buffers: float = 0.0  # device buffer sets (keys + values) allocated; 0 = one per decoder layer, as memfit.meft does (a Transfer per adapter)
    meft_buffer_fraction: float = 0.25  # device buffer rows per layer as a fraction of neurons (memfit.meft's default buffer_size: max(top_k, ceil(neurons/4))); seed 002's ~0.56·M values/batch implies ~26 %
    meft_param_transfer_bytes: float = 0.0  # bytes per adapter value moved H2D / gradient moved D2H; 0 = the buffer dtype, the activations' (memfit.meft's buffer_dtype="auto")
    # ---- CPU RAM ----------------------------------------------------------------------------------
    process_baseline_bytes: float = 2.0 * GiB  # resident size of a Python+torch(+CUDA libs) training process before the model
    process_baseline_bytes_cpu: float = 0.6e9  # CPU pseudo-device: peak RSS − allocator peak of a CPU-only torch+transformers process (bench/measure_grid.py: 578–610 MB)
    process_baseline_dist_cpu: float = 0.12e9  # CPU pseudo-device, world > 1: + gloo process group and engine imports per rank (bench/measure_grid.py 2-process rows: 700–750 MB)
    pinned_buffer_bytes: float = 1.0 * GiB  # DeepSpeed offload: pinned staging buffers per process (guess; FSDP pins its shards and gradient buffers instead: memfit.estimate.pinned)
    checkpoint_shard_bytes: float = 5e9  # one safetensors shard read at a time when loading straight to GPU / zero.Init
    save_shard_bytes: float = 50e9  # one safetensors file a save holds on the CPU when the engine hands it GPU tensors: transformers 5.24 save_pretrained max_shard_size="50GB" (modeling_utils.py:3325), safetensors _flatten_as_ptr moves each to the CPU and keeps it alive for the file
    # ---- bookkeeping --------------------------------------------------------------------------------
    calibrated: dict = field(default_factory=dict, compare=False)  # name -> measured relative error after calibration
    notes: str = ""

    @classmethod
    def constant_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name not in ("calibrated", "notes")]

    @classmethod
    def flag_names(cls) -> list[str]:
        """0/1 switches, not quantities: a calibration should leave them alone."""
        return ["activation_korthikanti", "qlora_fp32_upcast", "zero_overlap_comm"]

    @classmethod
    def calibratable_names(cls) -> list[str]:
        return [n for n in cls.constant_names() if n not in cls.flag_names()]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_values(self, **values: float) -> "Profile":
        bad = [k for k in values if k not in self.constant_names()]
        if bad:
            raise ConfigError(f"profile: unknown constant(s) {', '.join(bad)}; known: {', '.join(self.constant_names())}")
        return replace(self, **{k: float(v) for k, v in values.items()})

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "profile") -> "Profile":
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object of constant names to numbers")
        known = set(cls.constant_names())
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if key in ("calibrated", "notes") or key in RETIRED or key in MOVED_TO_STRATEGY:
                continue
            if key not in known:
                raise ConfigError(f"{source}: unknown constant {key!r}; known: {', '.join(sorted(known))}")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{source}: {key} must be a number, got {value!r}")
            values[key] = float(value)
        notes = str(raw.get("notes") or "")
        for key, strategy_key in MOVED_TO_STRATEGY.items():  # a profile saved before the switch moved
            if raw.get(key):
                notes = (notes + "; " if notes else "") + f"{key}={raw[key]} ignored: a strategy key now ({strategy_key})"
        calibrated = raw.get("calibrated") or {}
        if not isinstance(calibrated, dict):
            raise ConfigError(f"{source}: 'calibrated' must map constant names to measured errors")
        return cls(**values, calibrated=dict(calibrated), notes=notes)

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except OSError as err:
            raise ConfigError(f"profile {path}: cannot read ({err.strerror})") from None
        except json.JSONDecodeError as err:
            raise ConfigError(f"profile {path}: malformed JSON at line {err.lineno}: {err.msg}") from None
        return cls.from_dict(raw, source=str(path))

    def save(self, path: str | Path) -> Path:
        """Write atomically (memfit.io: temp file + rename, umask permissions)."""
        from memfit.io import write_json

        return write_json(path, self.to_dict(), "profile")


DEFAULT_PROFILE = Profile()
