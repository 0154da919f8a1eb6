"""LoRA (PEFT ``LoraConfig``): low-rank adapters on the chosen linears; the base stays frozen."""

from __future__ import annotations

from typing import Any

from memfit.errors import ConfigError
from memfit.methods.base import Method, enable_checkpointing, matched_linears, peft_target_modules


def model_linear_names(model: Any) -> list[str]:
    """One torch model's linear module names (leaf names, 4-bit linears included, the head excluded)."""
    import torch

    names = set()
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) or type(mod).__name__.startswith("Linear4bit"):
            names.add(name.rsplit(".", 1)[-1])
    names.discard("lm_head")
    return sorted(names)


class Lora(Method):
    name = family = "lora"
    fields = ("lora_r", "lora_alpha", "lora_dropout", "lora_targets")
    traced = True
    use_dora = False

    def rules(self, model: Any, hardware: Any, strategy: Any) -> list[str]:
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
                          target_modules=targets, bias="none", task_type="CAUSAL_LM", use_dora=self.use_dora)

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
