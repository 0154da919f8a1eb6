"""MEFT's settings (memfit.meft.MeftConfig under the strategy's names): the ``strategy.meft_*`` keys, written in
the run file as a ``meft:`` section (``SECTION``)."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, Field, model_validator

SECTION = ("meft", {"neurons": "meft_neurons", "top_k": "meft_top_k", "experts": "meft_experts",
                    "n_probe": "meft_n_probe", "buffer_size": "meft_buffer_size"})


class MeftSettings(BaseModel):
    """The sparse adapter beside every FFN: its neurons, those active per token, the router's experts and the
    experts it probes, the device rows buffered per layer."""

    meft_neurons: int = Field(8192, ge=1)
    meft_top_k: int = Field(64, ge=1)
    meft_experts: Union[int, Literal["auto"]] = "auto"
    meft_n_probe: int = Field(8, ge=1)
    meft_buffer_size: Optional[int] = Field(None, ge=1, description="device rows per layer for the batch's "
                                            "union of active neurons; None = max(top_k, neurons/4)")

    @model_validator(mode="after")
    def _meft_sizes(self):
        if self.meft_experts != "auto" and self.meft_experts < 1:
            raise ValueError("meft_experts must be 'auto' or a positive integer")
        if self.meft_buffer_size is not None and self.meft_buffer_size < self.meft_top_k:
            raise ValueError(f"meft_buffer_size={self.meft_buffer_size} is below meft_top_k={self.meft_top_k}: "
                             "the buffer must hold at least one token's neurons; raise it or leave it unset")
        return self
