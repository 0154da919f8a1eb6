"""What a method's cost hooks read, as protocols: the methods sit below memfit.spec and memfit.estimate in the
layers (tests/test_import_graph.py), so they name the attributes they use instead of importing those classes.
:class:`memfit.spec.model.ModelSpec`, :class:`memfit.spec.strategy.Strategy`,
:class:`memfit.estimate.constants.Profile` and :class:`memfit.estimate.memory.ModelNumbers` satisfy them."""

from __future__ import annotations

from typing import Iterable, Optional, Protocol, Union


class LinearLike(Protocol):
    name: str
    short: str
    in_features: int
    out_features: int
    count: int        # copies per layer (a mixture's experts)
    active: float     # share of the tokens each copy sees


class ModelLike(Protocol):
    name: str
    layers: int
    hidden: int
    heads: int
    q_dim: int
    kv_dim: int
    vocab: int
    parameters: int
    norms_per_layer: int
    tie_embeddings: bool
    linears: tuple[LinearLike, ...]
    biases: tuple
    config_json: dict

    def lora_linears(self, targets: Union[Iterable[str], str]) -> list[LinearLike]: ...

    def lora_parameters(self, targets: Union[Iterable[str], str], r: int) -> int: ...


class StrategyLike(Protocol):
    method: str
    engine: str
    precision: str
    seq_len: int
    micro_batch_size: int
    grad_accum: int
    gradient_checkpointing: bool
    zero_stage: int
    fsdp: Union[bool, str]
    lora_r: int
    lora_alpha: int
    lora_dropout: float
    lora_targets: tuple[str, ...]
    lora_rank_pattern: tuple[tuple[str, int], ...]
    lora_modules_to_save: tuple[str, ...]
    quant_storage: str
    double_quant: bool
    meft_neurons: int
    meft_top_k: int
    meft_experts: Union[int, str]
    meft_n_probe: int
    meft_buffer_size: Optional[int]
    peft_config: Optional[str]


class ProfileLike(Protocol):
    """The Profile constants the methods' terms read (each with its source in memfit.estimate.constants)."""

    checkpoint_extra_layers: float
    meft_buffer_fraction: float
    meft_param_transfer_bytes: float
    meft_live_buffers: float
    nf4_bytes_per_param: float
    nf4_absmax_bytes: float
    nf4_absmax_bytes_double_quant: float
    qlora_fp32_upcast: bool


class NumbersLike(Protocol):
    """Per-model sums the estimator computes once (memfit.estimate.memory.ModelNumbers)."""

    linear_params: float
    other_params: float
    largest_linear: float

    def lora_sums(self, targets: tuple) -> tuple[int, int, frozenset]: ...

    def adapted_linears(self, adapted: frozenset) -> tuple[int, tuple, int]: ...


class EstimateLike(Protocol):
    """What a method's plan note reads of an estimate (memfit.estimate.result.Estimate)."""

    model: ModelLike
    trainable_parameters: float
    gpu: dict
    cpu: dict


class HardwareLike(Protocol):
    world_size: int
    gpus_per_node: int
