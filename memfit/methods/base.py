"""What every fine-tuning method is: one object holding its config fields, its rules, its build step
for training (wrapping the loaded model, saving, loading) and its estimator hook.

The torch-free parts (fields, rules, target matching, the estimator hook) are read by ``memfit.spec``,
``memfit.estimate`` and ``memfit.plan``; the build, save and load steps import torch / transformers /
peft inside the function, so importing a method costs nothing. Imports only :mod:`memfit.errors`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, NamedTuple, Optional

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


def enable_checkpointing(model: Any) -> None:
    if hasattr(model, "activation_checkpointing_enable"):
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


class AdapterMemory(NamedTuple):
    """Device and host bytes of a method's own tensors (:meth:`Method.adapter_memory`)."""

    intermediates: float = 0.0   # saved adapter tensors (LoRA's rank-r outputs, dropout copies...): lora_intermediates
    buffers: float = 0.0         # device buffers incl. the saved tensors below: meft_buffers
    buffers_saved: float = 0.0   # of ``buffers``, the part saved for backward (an activation, not static)
    host: float = 0.0            # bytes per process in CPU RAM (MEFT's store)
    rows: float = 0.0            # MEFT's rows used per layer (the time model's adapter matmuls)


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


class Method:
    """A fine-tuning method. Subclasses set the class attributes and override the steps they change."""

    name = ""
    family = ""              # the estimator's memory model: "full" | "lora" | "qlora" | "meft"
    trains_base = False      # the base weights are trained (fp32 masters under mixed precision)
    output = "adapter"       # folder of the saved result in the run's output_dir
    fields: tuple[str, ...] = ()  # the Strategy keys this method reads (besides the common ones)
    planned = True           # in the planner's default search space
    traced = False           # ``memfit measure --traced`` can trace it (FakeTensorMode)

    # ---------------------------------------------------------------- plain Python
    def rules(self, model: Any, hardware: Any, strategy: Any) -> list[str]:
        """Reasons ``strategy`` cannot run this method on ``model`` / ``hardware`` whatever the memory."""
        return []

    # ---------------------------------------------------------------- the estimator's terms (plain Python)
    # The estimator (memfit.estimate) asks each method for its own memory terms; the engine and phase
    # logic stays there. ``profile`` is memfit.estimate's Profile, ``numbers`` its per-model ModelNumbers.
    fp32_adapters = False    # PEFT keeps the adapters in fp32 on a 16-bit base (unless DeepSpeed casts them)
    fsdp_adapter_units = False  # under FSDP1 every trainable leaf is a unit nested in its decoder layer (PEFT's
    #                             fsdp_auto_wrap_policy, which memfit's FSDP1 engine installs for LoRA-style methods)
    quantized = False        # the frozen base is 4-bit: dequantised one linear at a time, NF4 loading peak

    def parameters(self, model: Any, strategy: Any, profile: Any, numbers: Any, half: float) -> Parameters:
        """Trained parameters and frozen bytes (``half``: bytes of a value in the compute dtype)."""
        raise NotImplementedError

    def reported_trainable(self, model: Any, strategy: Any, trainable: float) -> float:
        """Trainable parameters as reported (``trainable`` plus any kept outside the GPU)."""
        return trainable

    def adapter_memory(self, model: Any, strategy: Any, profile: Any, numbers: Any, params: Parameters, *,
                       compute_bytes: float, cast_bytes: float, mask_bytes: float, rank_bytes: float,
                       on_cpu: bool) -> AdapterMemory:
        """The method's own activations and buffers: ``compute_bytes`` a value in the compute dtype,
        ``cast_bytes`` PEFT's cast of an adapter input (0: none), ``mask_bytes`` a dropout mask value,
        ``rank_bytes`` a value of the adapter path's outputs; ``on_cpu``: the device is this machine's RAM."""
        return NO_ADAPTER

    def working_weight_bytes(self, numbers: Any) -> float:
        """Weight bytes live beside the stored weights while a layer runs (QLoRA: one dequantised linear)."""
        return 0.0

    def gathered_per_element(self, strategy: Any, profile: Any) -> float:
        """Stored elements per parameter (ZeRO-3's gather limits count elements of the stored tensors)."""
        return 1.0

    def traffic(self, model: Any, strategy: Any, profile: Any) -> Optional[dict]:
        """CPU<->device bytes per step of the method itself (MEFT), for the time model; None: none."""
        return None

    # LoRA-style methods count their adapters; these two hooks add what a variant holds beyond them.
    def extra_trainable_parameters(self, model: Any, targets: Any) -> int:
        """Trained parameters beyond the family's (they get gradients and optimizer state like the rest)."""
        return 0

    def extra_saved_bytes(self, model: Any, strategy: Any, targets: Any, *, tokens: int, compute_bytes: float,
                          adapter_bytes: float, cast_bytes: float, layers: float) -> float:
        """Bytes saved for backward beyond the family's, over ``layers`` layers with saved activations
        (``tokens`` = micro-batch × sequence; ``compute_bytes``: a value of the base linear's output;
        ``adapter_bytes``: of the adapter path's outputs; ``cast_bytes``: PEFT's cast of the input to the
        adapter dtype, 0 when there is none)."""
        return 0.0

    def extra_layer_work(self, model: Any, strategy: Any, adapted: Any) -> LayerWork:
        """One layer's work per micro-batch beyond the family's, for the time model (memfit.steptime prices
        it). ``adapted``: the adapted linears' names. ``NO_WORK``: nothing beyond the family."""
        return NO_WORK

    def prompt_tokens(self, model: Any, strategy: Any) -> int:
        """Virtual tokens the method puts in front of every sequence (PEFT's prompt tuning): every layer, the
        attention and the head process seq_len + these; the tokens counted stay seq_len. 0 for most."""
        return 0

    def plan_note(self, estimate: Any) -> str:
        """A sentence for the planner's explanation where this method is listed: what it buys and where its
        case is ('' for none)."""
        return ""

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
