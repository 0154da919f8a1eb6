"""MeftConfig: the knobs of the MEFT sparse adapter.

The run file's ``meft`` section (``neurons``, ``top_k``, ``experts``, ``n_probe``; strategy keys
``meft_*``) maps onto the first four fields; the others have defaults that suit a 7B-class model.
Plain Python: importing this module does not import torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional, Union

from memfit.errors import ConfigError

BUFFER_DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_TARGET = r"(^|\.)layers\.\d+\.mlp$"


@dataclass
class MeftConfig:
    """Settings of the MEFT adapter (one per FFN of the decoder).

    neurons: key-value pairs (r) per layer, stored in CPU memory.
    top_k: neurons activated per token (K).
    experts: Key-Experts partitions (E); "auto" = ceil(sqrt(neurons)) // expert_factor; 1 = no router
        (brute-force top-K over all keys).
    n_probe: experts searched per token (clamped to E).
    buffer_size: device rows per layer for the union of the batch's active neurons (keys and values
        each get a buffer of buffer_size x hidden); None = max(top_k, ceil(neurons / 4)), capped at neurons.
    init_keys_from_ffn: initialise keys from the FFN's gate/up rows (else uniform +-1/sqrt(d)).
    target: regex over module names of the FFNs to extend (default: the ``mlp`` of each decoder layer).
    buffer_dtype: dtype of the device buffers and of the device-side adapter math; "auto" = the
        activations' dtype. The CPU store and its optimizer state are always float32.
    pin_memory: pin the CPU store and staging (None = when CUDA is available).
    seed: seed of the random initialisation.
    """

    neurons: int = 8192
    top_k: int = 64
    experts: Union[int, str] = "auto"
    n_probe: int = 8
    expert_factor: int = 1
    buffer_size: Optional[int] = None
    init_keys_from_ffn: bool = True
    target: str = DEFAULT_TARGET
    buffer_dtype: str = "auto"
    pin_memory: Optional[bool] = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("neurons", "top_k", "n_probe", "expert_factor"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"meft.{name}={value!r}: must be a positive integer")
        if self.top_k > self.neurons:
            raise ConfigError(
                f"meft.top_k={self.top_k} exceeds meft.neurons={self.neurons}: "
                "a token cannot activate more neurons than exist; lower top_k or raise neurons"
            )
        if self.experts != "auto":
            if not isinstance(self.experts, int) or isinstance(self.experts, bool) or self.experts < 1:
                raise ConfigError(f"meft.experts={self.experts!r}: must be 'auto' or a positive integer")
            if self.experts > self.neurons:
                raise ConfigError(
                    f"meft.experts={self.experts} exceeds meft.neurons={self.neurons}: "
                    "each expert needs at least one neuron; use 'auto' or a smaller number"
                )
        if self.buffer_size is not None:
            if not isinstance(self.buffer_size, int) or self.buffer_size < self.top_k:
                raise ConfigError(
                    f"meft.buffer_size={self.buffer_size!r}: must be an integer >= top_k ({self.top_k})"
                )
        if self.buffer_dtype not in BUFFER_DTYPES:
            raise ConfigError(
                f"meft.buffer_dtype={self.buffer_dtype!r}: allowed {', '.join(BUFFER_DTYPES)}"
            )
        if self.candidates_per_token < self.top_k:
            raise ConfigError(
                f"meft: n_probe={self.probes} experts of ~{self.expert_size} neurons give "
                f"{self.candidates_per_token} candidates per token, fewer than top_k={self.top_k}; "
                "raise n_probe or lower experts/top_k"
            )

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def requested_experts(self) -> int:
        if self.experts == "auto":
            return max(1, math.ceil(math.sqrt(self.neurons)) // self.expert_factor)
        return int(self.experts)

    @property
    def expert_size(self) -> int:
        """Neurons per expert (contiguous blocks; the last one may be smaller)."""
        return math.ceil(self.neurons / self.requested_experts)

    @property
    def num_experts(self) -> int:
        """Experts actually used: the requested E, less any that contiguous blocks would leave empty."""
        return math.ceil(self.neurons / self.expert_size)

    @property
    def uses_router(self) -> bool:
        return self.num_experts > 1

    @property
    def probes(self) -> int:
        return min(self.n_probe, self.num_experts)

    @property
    def candidates_per_token(self) -> int:
        """Keys scored per token: all of them without a router, else n_probe experts' worth (at most)."""
        if not self.uses_router:
            return self.neurons
        return min(self.neurons, self.probes * self.expert_size)

    @property
    def buffer_rows(self) -> int:
        if self.buffer_size is not None:
            return min(self.buffer_size, self.neurons)
        return min(self.neurons, max(self.top_k, math.ceil(self.neurons / 4)))

    # ---- conversions ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MeftConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"meft config: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}"
            )
        return cls(**data)

    @classmethod
    def from_strategy(cls, strategy: Any, **extra: Any) -> "MeftConfig":
        """Build from a memfit Strategy (its ``meft_*`` keys) plus optional extra fields."""
        return cls(
            neurons=strategy.meft_neurons,
            top_k=strategy.meft_top_k,
            experts=strategy.meft_experts,
            n_probe=strategy.meft_n_probe,
            **extra,
        )
