"""What every fine-tuning method is: one object holding its config fields, its rules, its build step
for training (wrapping the loaded model, saving, loading) and its estimator hook.

The torch-free parts (fields, rules, target matching, the estimator hook) are read by ``memfit.spec``,
``memfit.estimate`` and ``memfit.plan``; the build, save and load steps import torch / transformers /
peft inside the function, so importing a method costs nothing. Imports only :mod:`memfit.errors` and
:mod:`memfit.methods.types`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, NamedTuple, Optional

from memfit.methods.types import EstimateLike, HardwareLike, ModelLike, NumbersLike, ProfileLike, StrategyLike

GC_KWARGS = {"use_reentrant": False}  # non-reentrant checkpointing: no "tensors does not require grad" trap
ALL_LINEAR = "all-linear"


def matched_linears(names: Iterable[str], targets: Iterable[str] | str) -> list[str]:
    """Which of one decoder layer's linear ``names`` PEFT adapts for ``target_modules=targets``.

    The one place memfit matches LoRA targets (estimator, planner rules, trainer, trace). ``"all-linear"``
    (alone or among the targets) means every decoder-layer linear: PEFT excludes the output head, which
    is not among ``names``. A target ``a.b.q_proj`` matches the linear named ``q_proj``.
    """
    names = list(names)
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    if ALL_LINEAR in targets:
        return names
    wanted = {t.rsplit(".", 1)[-1] for t in targets}
    return [n for n in names if n in wanted]


def peft_target_modules(names: Iterable[str], targets: Iterable[str] | str) -> list[str] | str:
    """``LoraConfig(target_modules=...)``: ``"all-linear"`` as PEFT spells it, else the run's targets
    that match a linear (in the run's order; [] when none does)."""
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    if ALL_LINEAR in targets:
        return ALL_LINEAR
    present = set(matched_linears(names, targets))
    return [t for t in targets if t.rsplit(".", 1)[-1] in present]


def load_dtypes(strategy: Any, cuda: bool) -> tuple[Any, Any]:
    """(dtype the weights are loaded in, compute dtype) for ``strategy``'s precision and method: what
    the trainer loads, and what the FakeTensorMode trace loads to reproduce it. Mixed precision keeps
    fp32 master weights where the base is trained (full), the frozen base in half otherwise."""
    import torch

    from memfit.errors import IncompatibleError

    p = strategy.precision
    if p == "fp16-mixed" and not cuda:
        raise IncompatibleError("strategy.precision=fp16-mixed needs a CUDA GPU; on CPU use fp32 "
                                "(or bf16-mixed)")
    half = {"bf16-mixed": torch.bfloat16, "bf16": torch.bfloat16, "fp16-mixed": torch.float16}.get(p)
    if half is None:
        return torch.float32, torch.float32
    if p == "bf16":
        return torch.bfloat16, torch.bfloat16
    return (torch.float32 if get_trains_base(strategy) else half), half


def get_trains_base(strategy: Any) -> bool:
    from memfit.methods import METHODS

    return METHODS[strategy.method].trains_base


def weight_tensors(model: ModelLike) -> float:
    """Parameter tensors of the whole model: every weight, bias and norm of the layers, the embedding and the
    final norm, and the head unless tied (what the optimizer visits when everything trains)."""
    per_layer = len(model.linears) + len(model.biases) + model.norms_per_layer
    return float(model.layers * per_layer + 2 + (0 if model.tie_embeddings else 1))


def enable_checkpointing(model: Any, offload: bool = False) -> None:
    """Non-reentrant checkpointing of every decoder layer; ``offload``: the checkpointed layers' inputs in pinned
    host memory (transformers/modeling_utils.py:3160-3167; CUDA only: memfit.train.longctx)."""
    if offload:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=GC_KWARGS, offload=True)
    elif hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=GC_KWARGS)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=GC_KWARGS)


class Parameters(NamedTuple):
    """What a method trains and what it keeps frozen, as the estimator counts it (:meth:`Method.parameters`)."""

    trainable: float             # parameters with gradients and optimizer state where the engine keeps them
    frozen_bytes: float          # the frozen base's bytes at storage
    quant_state: float = 0.0     # NF4 absmax (+ nested quant): module attributes FSDP/ZeRO neither shard nor offload
    fp32_stream: bool = False    # QLoRA after prepare_model_for_kbit_training: fp32 embeddings, norms and head
    targets: Optional[tuple] = None  # LoRA targets as counted (None: the method adapts no linears)
    adapted: frozenset = frozenset()  # names of the adapted linears (empty when nothing is adapted)
    tensors: float = 0.0         # parameter tensors the optimizer visits (its per-tensor costs, the engines' hooks)
    outside: float = 0.0         # trained parameters kept outside the device (MEFT's store): reported, not priced here
    working_weight: float = 0.0  # weight bytes live beside the stored ones while a layer runs (QLoRA: one
    #                              dequantised linear at a time)


class AdapterMemory(NamedTuple):
    """Device and host bytes of a method's own tensors (:meth:`Method.adapter_memory`)."""

    intermediates: float = 0.0   # saved adapter tensors (LoRA's rank-r outputs, dropout copies...): lora_intermediates
    buffers: float = 0.0         # device buffers incl. the saved tensors below: meft_buffers
    buffers_saved: float = 0.0   # of ``buffers``, the part saved for backward (an activation, not static)
    host: float = 0.0            # bytes per process in CPU RAM (MEFT's store)
    rows: float = 0.0            # MEFT's rows used per layer (the time model's adapter matmuls)
    router: float = 0.0          # parameters of a router run per token (MEFT's, h x experts per layer)
    traffic: Optional["Traffic"] = None  # the method's own host <-> device bytes per step (MEFT)


class Traffic(NamedTuple):
    """A method's own host <-> device bytes per process and optimizer step (MEFT: memfit.methods.meft.memory)."""

    h2d: float
    d2h: float
    experts: int     # the router's experts (its CPU search reads them)


NO_ADAPTER = AdapterMemory()


class LayerWork(NamedTuple):
    """One decoder layer's work per micro-batch beyond the method family's (:meth:`Method.extra_layer_work`),
    priced by memfit.steptime on every device."""

    weight_bytes: float = 0.0          # moved once per forward whatever the tokens (twice under checkpointing)
    token_forward_bytes: float = 0.0   # per token, forward (again under checkpointing)
    token_backward_bytes: float = 0.0  # per token, backward
    forward_ops: float = 0.0           # host ops of the forward only
    ops: float = 0.0                   # host ops, forward + backward
    delta_linears: tuple = ()          # a second linear per token: (in, out, instances, in the adapter dtype, trains)
    weight_gemms: tuple = ()           # weight-sized products: (m, n, k, forward, backward, instances)
    kernels: tuple = (0.0, 0.0)        # small kernels beyond the GEMMs: (forward, backward)
    upload_bytes: float = 0.0          # converted on the host and copied to the device, waited for
    sync_ops: float = 0.0              # host synchronisations, in module-level host ops
    lora_like: tuple = ()              # wrapped linears doing LoRA's elementwise work: (in, out, instances)
    dropout: bool = False              # those wrappers apply dropout


NO_WORK = LayerWork()


COST_HOOKS = ("parameters", "adapter_memory", "gathered_per_element", "extra_layer_work", "prompt_tokens")
TRAINING_HOOKS = ("load_kwargs", "build", "optimizer", "callbacks", "save", "load", "parameters_outside")


class Method:
    """A fine-tuning method. Subclasses set the class attributes and override the steps they change: the
    cost hooks (``COST_HOOKS``, plain Python, typed) and the training steps (``TRAINING_HOOKS``, torch inside)."""

    name = ""
    family = ""              # the estimator's memory model: "full" | "lora" | "qlora" | "meft"
    trains_base = False      # the base weights are trained (fp32 masters under mixed precision)
    output = "adapter"       # folder of the saved result in the run's output_dir
    fields: tuple[str, ...] = ()  # the Strategy keys this method reads (besides the common ones)
    planned = True           # in the planner's default search space
    traced = False           # ``memfit measure --traced`` can trace it (FakeTensorMode)

    # ---------------------------------------------------------------- plain Python
    def rules(self, model: ModelLike, hardware: HardwareLike, strategy: StrategyLike) -> list[str]:
        """Reasons ``strategy`` cannot run this method on ``model`` / ``hardware`` whatever the memory."""
        return []

    def plan_note(self, estimate: EstimateLike) -> str:
        """A sentence for the planner's explanation where this method is listed: what it buys and where its
        case is ('' for none)."""
        return ""

    # ---------------------------------------------------------------- the cost hooks (plain Python)
    # The estimator (memfit.estimate) and the time model (memfit.steptime) ask each method for its own terms
    # through these five hooks and three flags; the engine and phase logic stays there. ``profile`` is
    # memfit.estimate's Profile, ``numbers`` its per-model ModelNumbers (memfit.methods.types says what is read).
    fp32_adapters = False    # PEFT keeps the adapters in fp32 on a 16-bit base (unless DeepSpeed casts them)
    fsdp_adapter_units = False  # under FSDP1 every trainable leaf is a unit nested in its decoder layer (PEFT's
    #                             fsdp_auto_wrap_policy, which memfit's FSDP1 engine installs for LoRA-style methods)
    quantized = False        # the frozen base is 4-bit: dequantised one linear at a time, NF4 loading peak

    def parameters(self, model: ModelLike, strategy: StrategyLike, profile: ProfileLike, numbers: NumbersLike,
                   half: float) -> Parameters:
        """Trained parameters and their tensors, frozen bytes, what is kept outside the device (``half``: bytes
        of a value in the compute dtype)."""
        raise NotImplementedError

    def adapter_memory(self, model: ModelLike, strategy: StrategyLike, profile: ProfileLike, numbers: NumbersLike,
                       params: Parameters, *, compute_bytes: float, cast_bytes: float, mask_bytes: float,
                       rank_bytes: float, on_cpu: bool) -> AdapterMemory:
        """The method's own activations, buffers and traffic: ``compute_bytes`` a value in the compute dtype,
        ``cast_bytes`` PEFT's cast of an adapter input (0: none), ``mask_bytes`` a dropout mask value,
        ``rank_bytes`` a value of the adapter path's outputs; ``on_cpu``: the device is this machine's RAM."""
        return NO_ADAPTER

    def gathered_per_element(self, strategy: StrategyLike, profile: ProfileLike) -> float:
        """Stored elements per parameter (ZeRO-3's gather limits count elements of the stored tensors)."""
        return 1.0

    def extra_layer_work(self, model: ModelLike, strategy: StrategyLike, adapted: frozenset) -> LayerWork:
        """One layer's work per micro-batch beyond the family's, for the time model (memfit.steptime prices
        it). ``adapted``: the adapted linears' names. ``NO_WORK``: nothing beyond the family."""
        return NO_WORK

    def prompt_tokens(self, model: ModelLike, strategy: StrategyLike) -> int:
        """Virtual tokens the method puts in front of every sequence (PEFT's prompt tuning): every layer, the
        attention and the head process seq_len + these; the tokens counted stay seq_len. 0 for most."""
        return 0

    # ---------------------------------------------------------------- training (torch inside)
    def load_kwargs(self, run: Any, compute_dtype: Any, engine: Any, local_rank: int, cuda: bool,
                    notes: list[str]) -> dict[str, Any]:
        """Extra ``from_pretrained`` keyword arguments (QLoRA: the 4-bit quantization config)."""
        return {}

    def build(self, model: Any, run: Any, engine: Any) -> tuple[Any, list[str]]:
        """(the loaded model ready to train, LoRA targets chosen or [])."""
        raise NotImplementedError

    def optimizer(self, model: Any, training: Any) -> Any:
        """The optimizer the Trainer must use for this method, or None for the Trainer's own."""
        return None

    def callbacks(self, model: Any) -> list[Any]:
        """Extra ``TrainerCallback``s (run before the metrics writer: they may add to each log line)."""
        return []

    def save(self, model: Any, tokenizer: Any, folder: Path, state_dict: Optional[dict] = None) -> None:
        """Write the trained result into ``folder`` (the caller makes it appear atomically)."""
        model.save_pretrained(str(folder), state_dict=state_dict, safe_serialization=True)
        if tokenizer is not None:  # a run on token ids has none
            tokenizer.save_pretrained(str(folder))

    def load(self, base_model: Any, folder: Path) -> Any:
        """The base model with the saved result applied (what ``save`` wrote)."""
        raise NotImplementedError

    def parameters_outside(self, model: Any) -> int:
        """Trained parameters the built model keeps outside its nn.Parameters (0: none)."""
        return 0
