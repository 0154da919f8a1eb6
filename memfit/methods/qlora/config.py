"""QLoRA's settings beyond LoRA's: how bitsandbytes stores the NF4 base (``BitsAndBytesConfig``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

QuantStorage = Literal["uint8", "bf16", "fp16", "fp32"]


class QLoraSettings(BaseModel):
    """``bnb_4bit_quant_storage`` (uint8, or a float dtype FSDP can shard with the rest) and
    ``bnb_4bit_use_double_quant`` (the absmax quantised again)."""

    quant_storage: QuantStorage = "uint8"
    double_quant: bool = True
