"""The facts of one estimate() call that every part reads: the engine, the method, the dtypes' bytes."""

from __future__ import annotations

from typing import Any, Optional

from memfit.engines import ENGINE_COSTS
from memfit.errors import ConfigError
from memfit.estimate import memory as M
from memfit.estimate.constants import DEFAULT_PROFILE, Profile
from memfit.spec.hardware import HardwareSpec
from memfit.spec.model import ModelSpec
from memfit.spec.strategy import Strategy


def profile_for(profile: Optional[Profile], model: ModelSpec, strategy: Strategy, activation_formula: Optional[str],
                distributed: Any, margin: float) -> Profile:
    """The Profile of this call (the run's DeepSpeed buckets, the activation formula), arguments checked."""
    chosen = profile or DEFAULT_PROFILE
    if distributed is not None and strategy.zero_stage:
        chosen = M.with_buckets(chosen, model, distributed)
    if activation_formula == "korthikanti" and not chosen.activation_korthikanti:
        chosen = chosen.with_values(activation_korthikanti=1.0)
    elif activation_formula not in (None, "derived", "korthikanti"):
        raise ConfigError(f"activation_formula {activation_formula!r}: use 'derived' or 'korthikanti'")
    if not 0.0 <= margin < 1.0:
        raise ConfigError(f"margin {margin}: must be a fraction in [0, 1), e.g. 0.05 keeps 5% of GPU memory free")
    return chosen


class Setup:
    """One call's facts. ``engine``: the engine's costs (memfit.engines). Bytes per *trainable* parameter:
    ``weight_b``, ``grad_b``, ``optim_b`` and ``copy_b`` (autocast's 16-bit copy); ``value_b``: bytes of a
    value in the compute dtype."""

    __slots__ = ("model", "hardware", "strategy", "profile", "method", "numbers", "gpu", "world", "engine",
                 "fsdp", "fsdp_version", "precision", "weight_b", "grad_b", "optim_b", "copy_b",
                 "fp32_adapters", "value_b", "total_params", "gc", "offload_optimizer", "offload_params",
                 "shard_weights", "shard_grads", "shard_optim")

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, strategy: Strategy, profile: Profile,
                 method: Any) -> None:
        self.model, self.hardware, self.strategy, self.profile, self.method = model, hardware, strategy, profile, method
        self.numbers = M.numbers(model)
        self.gpu, self.world = hardware.gpu, hardware.world_size
        self.engine = engine = ENGINE_COSTS[strategy.engine]
        self.fsdp = bool(strategy.fsdp)
        self.fsdp_version = engine.fsdp_version  # 1: FSDP1 (memfit.estimate.fsdp1)
        self.precision = precision = strategy.precision
        w_b, g_b, o_b, self.copy_b = M.state_bytes(precision, strategy.optimizer, engine.master_partition,
                                                   engine.fp32_params_are_master)
        # PEFT keeps LoRA adapters in fp32 unless DeepSpeed casts the whole module to 16-bit
        self.fp32_adapters = method.fp32_adapters and not engine.casts_module and precision != "fp32"
        if self.fp32_adapters:
            w_b, g_b, o_b = 4.0, 4.0, M.state_bytes("fp32", strategy.optimizer, False)[2]
        self.weight_b, self.grad_b, self.optim_b = w_b, g_b, o_b
        self.value_b = 4.0 if precision == "fp32" else 2.0
        self.total_params = float(model.parameters)
        self.gc = strategy.gradient_checkpointing
        self.offload_optimizer = strategy.offload != "none"
        self.offload_params = strategy.offload == "optimizer+params"
        self.shard_weights = engine.shards_parameters
        self.shard_grads = engine.shards_gradients
        self.shard_optim = engine.shards_optimizer

    def optimizer_dtypes(self) -> dict:
        """What the optimizer phase sweeps per trainable value, for the time model: ``grad_b``, bytes per
        gradient value (clipping reads and scales them), and ``adam_scale``, the update's bytes against the
        80 B of torch's foreach AdamW on fp32 values (the speeds' AdamW figures): the parameters' dtype over
        4 (a pure 16-bit full fine-tune under DDP / FSDP moves half; PEFT's fp32 adapters and fp32 masters
        all of it); bitsandbytes' 8-bit AdamW one fused kernel per tensor (bitsandbytes/optim/optimizer.py
        ``Optimizer8bit.update_step`` -> ``F.optimizer_update_8bit_blockwise``): the parameter read and
        written, the gradient read, each 1-byte moment read and written. DeepSpeed steps its fp32 master
        partition."""
        if self.engine.master_partition:
            return {"grad_b": 4.0, "adam_scale": 1.0}
        if self.strategy.optimizer == "adamw8bit":
            return {"grad_b": self.grad_b, "adam_scale": (2.0 * self.weight_b + self.grad_b + 4.0) / 80.0}
        return {"grad_b": self.grad_b, "adam_scale": self.weight_b / 4.0}
