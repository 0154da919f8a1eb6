"""LoRA's settings (also QLoRA's and DoRA's adapters): the ``strategy.lora_*`` keys, written in the run file as
a ``lora:`` section (``SECTION``) — PEFT's ``LoraConfig`` fields under memfit's names."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_serializer, field_validator

DEFAULT_LORA_TARGETS: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)
# the run file's ``lora:`` section: its keys -> the strategy's
SECTION = ("lora", {"r": "lora_r", "alpha": "lora_alpha", "dropout": "lora_dropout", "targets": "lora_targets",
                    "rslora": "lora_rslora", "modules_to_save": "lora_modules_to_save",
                    "rank_pattern": "lora_rank_pattern", "alpha_pattern": "lora_alpha_pattern"})


class LoraSettings(BaseModel):
    """The LoRA adapter (PEFT ``LoraConfig``: r, lora_alpha, lora_dropout, target_modules, use_rslora,
    modules_to_save, rank_pattern, alpha_pattern)."""

    lora_r: int = Field(16, ge=1)
    lora_alpha: int = Field(32, ge=1)
    lora_dropout: float = Field(0.05, ge=0.0, lt=1.0)
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    lora_rslora: bool = Field(False, description="rank-stabilised LoRA: scale by alpha/sqrt(r) (PEFT use_rslora)")
    lora_modules_to_save: tuple[str, ...] = Field((), description="modules trained whole beside the adapters "
                                                  "(PEFT modules_to_save), e.g. embed_tokens, lm_head")
    lora_rank_pattern: tuple[tuple[str, int], ...] = Field((), description="per-module ranks (PEFT rank_pattern)")
    lora_alpha_pattern: tuple[tuple[str, int], ...] = Field((), description="per-module alphas (PEFT alpha_pattern)")

    @field_validator("lora_targets", "lora_modules_to_save", mode="before")
    @classmethod
    def _one_name(cls, value):
        return (value,) if isinstance(value, str) else value  # lora.targets: all-linear

    @field_validator("lora_rank_pattern", "lora_alpha_pattern", mode="before")
    @classmethod
    def _pattern_pairs(cls, value):
        # a mapping {module name or regex: value} as PEFT takes it; kept as sorted pairs (hashable)
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"{k}: {v!r} is not a positive integer; give {{module name: rank}}, "
                                     "e.g. {q_proj: 32}")
            return tuple(sorted((str(k), int(v)) for k, v in value.items()))
        return value

    @field_serializer("lora_rank_pattern", "lora_alpha_pattern")
    def _pattern_mapping(self, value):
        return dict(value)  # written as PEFT writes it: {module: value}
