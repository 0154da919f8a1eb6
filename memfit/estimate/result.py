"""Estimate: the result of one estimate, and its ``to_dict()`` (the ``memfit estimate --json`` contract)."""

from __future__ import annotations

from typing import Any, Optional

from memfit.estimate.accuracy import long_context_error, published_error, run_kind
from memfit.steptime.speeds import GPU_PARTS
from memfit.steptime.accuracy import published_time_error

GPU_FORMULA_LINES = ("weights", "gradients", "optimizer", "activations", "logits", "lora_intermediates", "meft_buffers",
                     "step_temporaries")
GPU_ENGINE_LINES = ("gathered_params", "comm_buffers")
# "peak_concurrency" (kind formula, never positive): the adjustment from the sum of the component peaks to
# the step's peak, because gradients, activations, logits and optimizer-step temporaries are not all live
# at once.
GPU_OVERHEAD_LINES = ("cuda_context", "nccl_buffers", "allocator_fragmentation")


class Estimate:
    """The estimate of one (model, hardware, strategy); ``to_dict()`` gives the JSON contract."""

    __slots__ = ("model", "hardware", "strategy", "gpu", "gpu_overhead", "cpu", "cpu_phase", "time",
                 "traffic", "fits", "reasons", "trainable_parameters", "floor_memory", "floor_seconds",
                 "margin", "usable_gpu_bytes", "attention_backend", "gpu_loading", "gpu_needed", "phases",
                 "gpu_phase", "phase_settings")

    def __init__(self, model, hardware, strategy, gpu, gpu_overhead, cpu, cpu_phase, time, traffic, fits,
                 reasons, trainable_parameters, floor_memory, floor_seconds, margin, usable_gpu_bytes,
                 attention_backend: str = "", gpu_loading: float = 0.0, gpu_needed: float = 0.0,
                 phases: Optional[dict] = None, gpu_phase: str = "train_step",
                 phase_settings: Optional[dict] = None) -> None:
        self.model, self.hardware, self.strategy = model, hardware, strategy
        self.gpu, self.gpu_overhead, self.cpu, self.cpu_phase = gpu, gpu_overhead, cpu, cpu_phase
        self.time, self.traffic, self.fits, self.reasons = time, traffic, fits, reasons
        self.trainable_parameters = trainable_parameters
        self.floor_memory, self.floor_seconds = floor_memory, floor_seconds
        self.margin, self.usable_gpu_bytes = margin, usable_gpu_bytes
        self.attention_backend = attention_backend
        self.gpu_loading = gpu_loading  # tensors on a GPU while loading, when that can exceed training
        # what the card must hold (the verdict's figure): gpu_total less the wholly free cached segments the
        # allocator releases when the device runs out (memfit.estimate.cuda.gap_parts); 0: gpu_total
        self.gpu_needed = gpu_needed or gpu["total"]
        # run phases (memfit.estimate.phases): {phase: (per-GPU bytes held, per-node CPU RAM)}; the largest sets
        # gpu_needed and cpu["total"]
        self.phases = phases or {"train_step": (self.gpu_needed, cpu["total"])}
        self.gpu_phase, self.phase_settings = gpu_phase, phase_settings or {}

    @property
    def gpu_allocated(self) -> float:
        """Peak bytes in tensors (``torch.cuda.max_memory_allocated``)."""
        return self.gpu["total"] - self.gpu["overhead"]

    @property
    def gpu_reserved(self) -> float:
        """Peak bytes the caching allocator holds (``torch.cuda.max_memory_reserved``); ``nvidia-smi`` shows
        this + CUDA context + NCCL buffers (= ``gpu_total``, what is held against the card)."""
        return self.gpu_allocated + self.gpu_overhead["allocator_fragmentation"]

    @property
    def gpu_total(self) -> float:
        return self.gpu["total"]

    @property
    def cpu_total(self) -> float:
        return self.cpu["total"]

    @property
    def step_seconds(self) -> float:
        return self.time["step_seconds"]

    @property
    def tokens_per_second(self) -> float:
        return self.time["tokens_per_second"]

    def __repr__(self) -> str:
        return (f"Estimate({self.model.name}, {self.hardware.describe()}, {self.strategy.label()}, "
                f"gpu={self.gpu_total / 1e9:.2f}GB, step={self.step_seconds:.3f}s, fits={self.fits})")

    def to_dict(self) -> dict[str, Any]:
        hw = self.hardware
        strategy = self.strategy.model_dump(mode="json")
        strategy["lora_targets"] = list(self.strategy.lora_targets)
        return {
            "model": {"name": self.model.name, "parameters": self.model.parameters,
                      "trainable_parameters": int(self.trainable_parameters)},
            "hardware": {"gpu": hw.gpu.name, "gpus_per_node": hw.gpus_per_node, "nodes": hw.nodes,
                         "gpu_memory_bytes": int(hw.gpu.memory_bytes), "cpu_ram_bytes": int(hw.cpu_ram_bytes)},
            "strategy": strategy,
            "memory": {
                "gpu_bytes": {k: int(round(v)) for k, v in self.gpu.items()},
                "gpu_overhead_bytes": {k: int(round(v)) for k, v in self.gpu_overhead.items()},
                "gpu_line_kinds": {**{k: "formula" for k in GPU_FORMULA_LINES},
                                   **{k: "engine" for k in GPU_ENGINE_LINES}, "peak_concurrency": "formula",
                                   "overhead": "overhead"},
                "gpu_allocated_bytes": int(round(self.gpu_allocated)),
                "gpu_reserved_bytes": int(round(self.gpu_reserved)),
                "held_against_capacity": "gpu_bytes.total = reserved + CUDA context + NCCL buffers",
                "gpu_needed_bytes": int(round(self.gpu_needed)),
                "needed": "gpu_needed_bytes = what the verdict holds against the usable memory: the largest run "
                          "phase's figure (run_phases, gpu_peak_phase); the training step's is gpu_bytes.total "
                          "less the wholly free cached segments the caching allocator releases and retries with when "
                          "the card is full (split segments holding live blocks are never released)",
                "attention_backend": self.attention_backend,
                "gpu_loading_bytes": int(round(self.gpu_loading)),
                "published_error": published_error(run_kind(self.strategy.method, self.strategy.zero_stage,
                                                            self.strategy.fsdp, self.strategy.offload,
                                                            hw.world_size)),
                "usable_gpu_bytes": int(self.usable_gpu_bytes),
                "margin": self.margin,
                "cpu_bytes": {k: int(round(v)) for k, v in self.cpu.items()},
                "cpu_peak_phase": self.cpu_phase,
                "run_phases": {k: {"gpu_bytes": int(round(g)), "cpu_bytes": int(round(c))}
                               for k, (g, c) in self.phases.items()},
                "gpu_peak_phase": self.gpu_phase,
                "phase_settings": self.phase_settings,
            },
            "time": {**self.time, "step_is": "one optimizer step (grad_accum micro-batches per GPU)",
                     "published_error": published_time_error(run_kind(
                         self.strategy.method, self.strategy.zero_stage, self.strategy.fsdp, self.strategy.offload,
                         hw.world_size)) if self.time.get("basis") == GPU_PARTS else None},
            "long_context_error": long_context_error(self.strategy),
            "traffic": {k: int(round(v)) for k, v in self.traffic.items()},
            "floors": {"memory_bytes": int(round(self.floor_memory)), "step_seconds": self.floor_seconds},
            "fits": self.fits,
            "reasons": list(self.reasons),
        }
