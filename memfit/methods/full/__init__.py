"""Full fine-tuning: every weight trained, saved as a whole model folder."""

from __future__ import annotations

from typing import Any

from memfit.methods.base import Method, Parameters, enable_checkpointing, weight_tensors
from memfit.methods.types import ModelLike, NumbersLike, ProfileLike, StrategyLike


class Full(Method):
    name = family = "full"
    trains_base = True
    output = "model"
    traced = True

    def parameters(self, model: ModelLike, strategy: StrategyLike, profile: ProfileLike, numbers: NumbersLike,
                   half: float) -> Parameters:
        return Parameters(float(model.parameters), 0.0, tensors=weight_tensors(model))

    def build(self, model: Any, run: Any, engine: Any) -> tuple[Any, list[str]]:
        if run.strategy.gradient_checkpointing:
            enable_checkpointing(model)
        return model, []

    def load(self, base_model: Any, folder) -> Any:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(folder))


METHOD = Full()
