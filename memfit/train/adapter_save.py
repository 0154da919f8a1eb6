"""An adapter gathered from FSDP1's nested units, written in PEFT's format (save.mode=adapter, #39).

PEFT's ``get_peft_model_state_dict`` finds the adapter's keys from the model's module names, removing only a
leading ``_fsdp_wrapped_module.`` (peft 0.21.2 ``tuners_utils._get_tuner_state_dict_key_prefixes``); under
FSDP1 with PEFT's wrap policy every decoder layer and every lora_A / lora_B is a nested unit, so no key matches
and ``save_pretrained(state_dict=...)`` writes an empty adapter. This writes what it would have: the keys without
the adapter's name (``_remove_adapter_name_from_key``: ``.default`` dropped; DoRA's magnitude without
``.weight``), ``adapter_model.safetensors`` and the adapter's config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def peft_keys(state_dict: dict, adapter: str) -> dict:
    """``state_dict``'s keys as PEFT saves them: the adapter's name removed."""
    out = {}
    for key, value in state_dict.items():
        key = key.replace(f".{adapter}.", ".").removesuffix(f".{adapter}")
        if key.endswith("lora_magnitude_vector.weight"):
            key = key.removesuffix(".weight")
        out[key] = value.detach().contiguous()
    return out


def save_gathered_adapter(model: Any, tokenizer: Any, folder: Path, state_dict: dict) -> None:
    """Write the gathered adapter ``state_dict`` (the unwrapped PeftModel's key names) into ``folder``."""
    from safetensors.torch import save_file

    adapter = getattr(model, "active_adapter", "default")
    folder = Path(folder)
    save_file(peft_keys(state_dict, adapter), str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    model.peft_config[adapter].save_pretrained(str(folder))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
