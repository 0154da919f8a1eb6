"""LoRA (PEFT ``LoraConfig``): low-rank adapters on the chosen linears; the base stays frozen."""

from __future__ import annotations

import re
from typing import Any

from memfit.errors import ConfigError
from memfit.methods.lora.config import LoraSettings
from memfit.methods.base import (ALL_LINEAR, NO_ADAPTER, AdapterMemory, Method, Parameters, enable_checkpointing,
                                 matched_linears, peft_target_modules)
from memfit.methods.types import ModelLike, NumbersLike, ProfileLike, StrategyLike


def model_linear_names(model: Any) -> list[str]:
    """One torch model's linear module names (leaf names, 4-bit linears included, the head excluded)."""
    import torch

    names = set()
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) or type(mod).__name__.startswith("Linear4bit"):
            names.add(name.rsplit(".", 1)[-1])
    names.discard("lm_head")
    return sorted(names)


def intermediate_bytes(model: Any, numbers: Any, s: int, b: int, e: float, targets, r: int, dropout: float,
                       checkpointing: bool, profile: Any, cast_copy: float = 0.0, mask_bytes: float = 1.0) -> float:
    """Per adapted linear: the rank-r intermediate (s·b·r, fp32 when PEFT casts to fp32 adapters in pure
    bf16) and the input lora_A saves when it is its own copy: with lora_dropout > 0 the dropped copy (or
    the cast of it, ``cast_copy`` bytes per value) and the dropout mask (``mask_bytes``: a 1-byte mask
    from CUDA's fused dropout, a noise tensor in the input's dtype on CPU); without dropout the cast
    copy, else nothing (lora_A reads the base linear's input: counted with the activations). With
    checkpointing only the recomputed layer(s)."""
    count, sum_in, _ = numbers.lora_sums(targets)
    copy = ((cast_copy or e) + mask_bytes) if dropout > 0 else cast_copy
    rank = 4.0 if cast_copy == 4.0 else e
    per_layer = (count * rank * r + copy * sum_in) * b * s
    layers = profile.checkpoint_extra_layers if checkpointing else model.layers
    return per_layer * layers


def pattern_value(pattern: tuple, leaf: str, default: int) -> int:
    """PEFT's rank_pattern / alpha_pattern for a linear named ``leaf``: a key matches as PEFT matches it
    (peft/tuners/tuners_utils.py get_pattern_key: the key, a regex, against the module name's end); the
    estimator reads it per leaf name, so a key naming one layer (``layers.0.q_proj``) counts for all."""
    for key, value in pattern:
        last = key.rsplit(".", 1)[-1]
        try:
            if re.fullmatch(last, leaf):
                return value
        except re.error:
            if last == leaf:
                return value
    return default


SAVED_MODULES = {"embed_tokens": "embedding", "wte": "embedding", "word_embeddings": "embedding",
                 "lm_head": "head", "embed_out": "head"}


def modules_to_save_parameters(model: Any, names: tuple) -> tuple[int, bool]:
    """(parameters of PEFT's trainable copies for ``modules_to_save``, whether the head is among them).
    PEFT's ModulesToSaveWrapper (peft/utils/other.py) deep-copies each module and trains the copy; the
    original stays frozen. A tied head gets its own copy (vocab x hidden) like an untied one."""
    total, head = 0, False
    for name in names:
        kind = SAVED_MODULES.get(name.rsplit(".", 1)[-1])
        if kind is None:
            continue
        total += model.vocab * model.hidden
        head = head or kind == "head"
    return total, head


class Lora(Method):
    name = family = "lora"
    fsdp_adapter_units = True  # lora_A / lora_B as FSDP1 units (QLoRA and DoRA inherit it)
    fields = tuple(LoraSettings.model_fields)  # memfit/methods/lora/config.py
    traced = True
    use_dora = False
    fp32_adapters = True

    # ---------------------------------------------------------------- the estimator's terms
    def counted_targets(self, strategy: Any, numbers: Any) -> tuple:
        """The targets as counted: PEFT's Llama-style default on a model without those names means all linears."""
        targets = strategy.lora_targets
        if not numbers.lora_sums(targets)[0] and targets == type(strategy).model_fields["lora_targets"].default:
            return (ALL_LINEAR,)
        return targets

    def frozen(self, model: ModelLike, strategy: StrategyLike, profile: ProfileLike, numbers: NumbersLike,
               half: float) -> tuple[float, float, bool]:
        """(frozen base bytes, quantisation state bytes, fp32 residual stream): 16-bit weights (QLoRA overrides)."""
        return float(model.parameters) * half, 0.0, False

    # a LoRA variant's own terms beyond the family's (DoRA: its magnitude vectors and weight norm)
    def extra_trainable_parameters(self, model: ModelLike, targets: tuple) -> int:
        """Trained parameters beyond the family's (they get gradients and optimizer state like the rest)."""
        return 0

    def extra_saved_bytes(self, model: ModelLike, strategy: StrategyLike, targets: tuple, *, tokens: int,
                          compute_bytes: float,
                          adapter_bytes: float, cast_bytes: float, layers: float) -> float:
        """Bytes saved for backward beyond the family's, over ``layers`` layers with saved activations
        (``tokens`` = micro-batch × sequence; ``compute_bytes``: a value of the base linear's output;
        ``adapter_bytes``: of the adapter path's outputs; ``cast_bytes``: PEFT's cast of the input to the
        adapter dtype, 0 when there is none)."""
        return 0.0

    def adapter_parameters(self, model: Any, strategy: Any, targets: Any) -> int:
        """r x (in + out) per adapted linear over the layers, each at its rank_pattern rank; + the trainable
        copies of modules_to_save."""
        if not strategy.lora_rank_pattern and not strategy.lora_modules_to_save:
            return model.lora_parameters(targets, strategy.lora_r)
        per_layer = sum(lin.count * pattern_value(strategy.lora_rank_pattern, lin.short, strategy.lora_r)
                        * (lin.in_features + lin.out_features) for lin in model.lora_linears(targets))
        return model.layers * per_layer + modules_to_save_parameters(model, strategy.lora_modules_to_save)[0]

    def mean_rank(self, model: Any, strategy: Any, targets: Any) -> float:
        """The rank of the adapters' intermediates, averaged over the adapted linears (rank_pattern)."""
        if not strategy.lora_rank_pattern:
            return strategy.lora_r
        lins = model.lora_linears(targets)
        total = sum(lin.count * lin.active for lin in lins)
        return sum(lin.count * lin.active * pattern_value(strategy.lora_rank_pattern, lin.short, strategy.lora_r)
                   for lin in lins) / total if total else strategy.lora_r

    def parameters(self, model: ModelLike, strategy: StrategyLike, profile: ProfileLike, numbers: NumbersLike,
                   half: float) -> Parameters:
        targets = self.counted_targets(strategy, numbers)
        trainable = float(self.adapter_parameters(model, strategy, targets)
                          + self.extra_trainable_parameters(model, targets))
        adapted = numbers.lora_sums(targets)[2] if trainable else frozenset()
        frozen_bytes, quant_state, fp32_stream = self.frozen(model, strategy, profile, numbers, half)
        return Parameters(trainable, frozen_bytes, quant_state, fp32_stream, targets, adapted,
                          tensors=float(model.layers * len(adapted) * 2))  # A and B per adapted linear

    def adapter_memory(self, model: ModelLike, strategy: StrategyLike, profile: ProfileLike, numbers: NumbersLike,
                       params: Parameters, *,
                       compute_bytes: float, cast_bytes: float, mask_bytes: float, rank_bytes: float,
                       on_cpu: bool) -> AdapterMemory:
        if not params.adapted:
            return NO_ADAPTER
        st, tokens, gc = strategy, strategy.micro_batch_size * strategy.seq_len, strategy.gradient_checkpointing
        b, s = st.micro_batch_size, st.seq_len
        saved = intermediate_bytes(model, numbers, s, b, compute_bytes, params.targets,
                                   self.mean_rank(model, st, params.targets), st.lora_dropout,
                                   gc, profile, cast_copy=cast_bytes, mask_bytes=mask_bytes)
        if modules_to_save_parameters(model, st.lora_modules_to_save)[1]:  # a trained head keeps its input
            saved += float(b) * s * model.hidden * compute_bytes
        if st.lora_dropout > 0 and not gc:  # layer 0: dropout on an input that needs no gradient keeps
            # no mask (checkpointing makes the embeddings' output require grad: then it does)
            saved -= float(b) * s * mask_bytes * numbers.adapted_linears(params.adapted)[2]
        saved += self.extra_saved_bytes(
            model, st, params.targets, tokens=tokens, compute_bytes=compute_bytes, adapter_bytes=rank_bytes,
            cast_bytes=cast_bytes, layers=profile.checkpoint_extra_layers if gc else model.layers)
        return AdapterMemory(intermediates=saved)

    def rules(self, model: Any, hardware: Any, strategy: Any) -> list[str]:
        unknown = [m for m in strategy.lora_modules_to_save if m.rsplit(".", 1)[-1] not in SAVED_MODULES]
        if unknown:
            return [f"lora.modules_to_save {unknown[0]!r}: memfit counts the embeddings and the head "
                    f"({', '.join(sorted(SAVED_MODULES))}); for other modules use method=peft with a peft_config"]
        names = model.linear_names()
        if not names or matched_linears(names, strategy.lora_targets):
            return []
        return [f"lora_targets={','.join(strategy.lora_targets)}: {model.name} has no such layer; its linear "
                f"layers are {','.join(names)} (set --lora-targets to some of them, or all-linear)"]

    def peft_config(self, strategy: Any, linear_names: list[str]):
        """The ``peft.LoraConfig`` for ``strategy`` on a model with these linears (trainer and trace)."""
        from peft import LoraConfig

        targets = peft_target_modules(linear_names, strategy.lora_targets)
        if not targets:
            raise ConfigError(f"strategy.lora_targets {list(strategy.lora_targets)}: none is a linear layer of "
                              f"this model; it has {sorted(linear_names)} (or use lora.targets=[all-linear])")
        return LoraConfig(r=strategy.lora_r, lora_alpha=strategy.lora_alpha, lora_dropout=strategy.lora_dropout,
                          target_modules=targets, bias="none", task_type="CAUSAL_LM", use_dora=self.use_dora,
                          use_rslora=strategy.lora_rslora,
                          modules_to_save=list(strategy.lora_modules_to_save) or None,
                          rank_pattern=dict(strategy.lora_rank_pattern),
                          alpha_pattern=dict(strategy.lora_alpha_pattern))

    def prepare_base(self, model: Any, run: Any, engine: Any) -> Any:
        """Before wrapping: gradient checkpointing (QLoRA: k-bit preparation)."""
        if run.strategy.gradient_checkpointing:
            enable_checkpointing(model)
        return model

    def build(self, model: Any, run: Any, engine: Any) -> tuple[Any, list[str]]:
        from peft import get_peft_model

        model = self.prepare_base(model, run, engine)
        cfg = self.peft_config(run.strategy, model_linear_names(model))
        targets = cfg.target_modules
        targets = [targets] if isinstance(targets, str) else list(targets)
        return get_peft_model(model, cfg), targets

    def load(self, base_model: Any, folder) -> Any:
        from peft import PeftModel

        return PeftModel.from_pretrained(base_model, str(folder))


METHOD = Lora()
