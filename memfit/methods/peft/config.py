"""The ``peft_config`` of a run, plain Python: a mapping as ``adapter_config.json`` holds it (the run file's
``peft_config:`` block), or the path of an adapter_config.json (or of the folder holding one), made into
canonical JSON text (sorted keys) so a Strategy stays hashable and one config has one form. PEFT itself
checks the fields when the adapter is counted or built (:mod:`memfit.methods.peft.count`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, field_validator

# PEFT's own PeftType values at the pinned peft 0.21.2 (peft/utils/peft_types.py); BONE was renamed MISS
PEFT_TYPES = ("ADALORA", "ADAMSS", "ADAPTION_PROMPT", "BEFT", "BOFT", "C3A", "CARTRIDGE", "CPT", "DEFT", "DELORA",
              "FOURIERFT", "FROD", "GLORA", "GRALORA", "HIRA", "HRA", "IA3", "LILY", "LN_TUNING", "LOHA", "LOKR",
              "LORA", "MISS", "MULTITASK_PROMPT_TUNING", "OFT", "OSF", "PEANUT", "POLY", "PREFIX_TUNING",
              "PROMPT_TUNING", "PSOFT", "PVERA", "P_TUNING", "RANDLORA", "ROAD", "SHADOW", "SHIRA", "SUPERTUNING",
              "TINYLORA", "TRAINABLE_TOKENS", "UNILORA", "VBLORA", "VERA", "WAVEFT", "XLORA")
# keys adapter_config.json carries that say where the adapter came from, not what it is
_PROVENANCE = ("base_model_name_or_path", "revision", "inference_mode", "auto_mapping", "peft_version")


def _read(path: Path) -> dict:
    if path.is_dir():
        path = path / "adapter_config.json"
    if not path.is_file():
        raise ValueError(f"{path}: no such adapter_config.json; give a mapping of PEFT config keys "
                         "(peft_type: IA3, target_modules: [...]) or the path of a saved adapter's config")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a readable JSON adapter_config.json ({err}); save it with "
                         "PeftConfig.save_pretrained") from None
    return data


def canonical(value: Any) -> str:
    """Canonical JSON text of a PEFT config given as a mapping, JSON text or an adapter_config.json path.
    A ValueError (one line: the field, what is allowed, the fix) when it is not one."""
    if isinstance(value, str):
        text = value.strip()
        data = json.loads(text) if text.startswith("{") else _read(Path(text).expanduser())
    elif isinstance(value, dict):
        data = value
    else:
        raise ValueError("must be a mapping of PEFT config keys (peft_type: IA3, target_modules: [...]) or the "
                         "path of an adapter_config.json")
    if not isinstance(data, dict):
        raise ValueError("must be a mapping of PEFT config keys, e.g. {peft_type: IA3, target_modules: [k_proj]}")
    kind = str(data.get("peft_type") or "").upper()
    if kind not in PEFT_TYPES:
        shown = data.get("peft_type")
        raise ValueError(f"peft_type {shown!r} is not a PEFT method; allowed: {', '.join(PEFT_TYPES)} "
                         "(set peft_config.peft_type to one of them)")
    if kind in ("LORA", "XLORA", "POLY", "CPT", "MULTITASK_PROMPT_TUNING", "CARTRIDGE"):
        hint = ("use method=lora (rank, alpha, targets, rank_pattern in the lora: section)" if kind == "LORA"
                else "it needs a task- or expert-specific setup memfit does not train")
        raise ValueError(f"peft_type {kind}: not through method=peft; {hint}")
    data = {k: v for k, v in data.items() if k not in _PROVENANCE}
    data["peft_type"] = kind
    data.setdefault("task_type", "CAUSAL_LM")
    try:
        return json.dumps(data, sort_keys=True)
    except (TypeError, ValueError) as err:
        raise ValueError(f"a value is not plain JSON ({err}); use numbers, strings, lists and mappings") from None


def loads(text: str) -> dict:
    return json.loads(text)


class PeftSettings(BaseModel):
    """method=peft: the PEFT config (adapter_config.json's keys) as canonical JSON text; the run file's
    ``peft_config:`` block (a mapping, or the path of an adapter_config.json) folds into it."""

    peft_config: Optional[str] = None

    @field_validator("peft_config", mode="before")
    @classmethod
    def _peft_config_text(cls, value):
        return None if value is None else canonical(value)
