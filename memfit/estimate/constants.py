"""Profile: every free constant of the estimator in one place, so measurement can calibrate it (the time
model's half is memfit.steptime.constants.TimeProfile, which Profile extends).

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
from memfit.steptime.constants import TimeProfile

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
class Profile(TimeProfile):
    """Every free constant: the time model's (memfit.steptime.constants.TimeProfile, inherited: one flat set of
    names in a saved profile) and the memory model's below."""

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
    zero3_sub_group_size: float = 1e9  # ZeRO-3 steps its partition in sub-groups of at least this many local elements (cut after the parameter that reaches it), so the fp32 copy spans one: DeepSpeed's default sub_group_size (deepspeed 0.19.8 runtime/zero/config.py:182; stage3.py _create_fp16_sub_groups), which memfit's DeepSpeed config leaves
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
    process_baseline_load_cpu: float = 0.38e9  # CPU pseudo-device, loading: RSS of a process that has imported torch, transformers and safetensors and loaded a model, less the model's bytes (memfit train's build_model on the demo model, fp32 full fine-tuning, this machine 2026-12-07: 384 MB with 3.4 MB of weights; bench: tests/estimate/test_load_phase_cpu.py)
    process_peft_import_cpu: float = 0.057e9  # + PEFT's import where the method is built by PEFT (LoRA on the demo model: 441 MB against 384, 0.6 MB of it adapters; same source)
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
