"""The long-context levers ``memfit train`` installs on the built model (docs/long-context.md, issue #36).

- ``activation_offload: checkpointed``: the checkpointed layers' inputs kept in host memory. On CUDA this is
  transformers' own ``activation_checkpointing_enable(offload=True)`` (transformers/modeling_utils.py:3160-3167:
  ``save_on_cpu(pin_memory=True)`` around each layer's ``checkpoint``; torch 2.13's non-reentrant checkpoint saves
  the layer's inputs through the saved-tensor hooks, torch/utils/checkpoint.py:843). On a CPU-only torch that
  path cannot run: it passes ``device_type="cpu"`` (modeling_utils.py:3163), ``torch.cpu.is_available()`` is
  True, so ``save_on_cpu`` asks for a pinned buffer (torch/autograd/graph.py:405-407) and torch raises
  "pin_memory=True requires a CUDA or other accelerator backend". memfit then wraps each checkpointed layer's
  checkpoint function (the attribute transformers sets, modeling_utils.py:3240-3242) in the same hooks without
  pinning, counting what they pack.
- ``activation_offload: all``: every tensor saved for backward, torch's ``autograd.graph.save_on_cpu``
  (``pin_memory`` on CUDA) around the Trainer's training step (forward and loss; backward unpacks).
- ``tiled_mlp``: DeepSpeed's ``TiledMLP`` (deepspeed/runtime/sequence_parallel/ulysses_sp.py:955) installed on
  each decoder layer's ``mlp`` the way its docstring patches LlamaMLP (ulysses_sp.py:975-997): tiles of
  ``hidden_size`` tokens (ceil(seq / hidden), agreed across ranks by an all-reduce MAX), the module's own forward
  run per tile without grad and again per tile in backward. Installed per module, not on the class, so
  another run in the same process is untouched.

:class:`OffloadHooks` counts the bytes the pack hook receives (``bytes`` in this process since the counter
was reset): what leaves the device on a GPU, what would leave it on the CPU (where ``save_on_cpu`` keeps the
tensor: ``tensor.cpu()`` of a CPU tensor is the tensor itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from memfit.errors import ConfigError


@dataclass
class OffloadCount:
    """What the offload hooks packed (and unpacked) in this process."""

    tensors: int = 0
    bytes: int = 0
    weight_bytes: int = 0      # of ``bytes``, weights (a parameter or a view of one: a linear saves W^T for the
    #                            gradient of its input), as storage shared with the model's parameters tells
    unpacked: int = 0
    per_step: list = field(default_factory=list)  # (bytes, weight_bytes) packed in each optimizer step (callback)
    storages: set = field(default_factory=set)  # the parameters' storage addresses (install)

    def reset(self) -> None:
        self.tensors = self.bytes = self.weight_bytes = self.unpacked = 0

    def watch(self, model: Any) -> None:
        self.storages = {p.untyped_storage().data_ptr() for p in model.parameters() if p.numel()}


def offload_hooks(count: OffloadCount, pin_memory: bool) -> Any:
    """torch's ``save_on_cpu`` (torch/autograd/graph.py:350) whose pack / unpack hooks also count."""
    import torch
    from torch.autograd.graph import save_on_cpu

    class OffloadHooks(save_on_cpu):
        def __init__(self) -> None:
            super().__init__(pin_memory=pin_memory, device_type="cuda")
            pack, unpack = self.pack_hook, self.unpack_hook

            def counted_pack(tensor: torch.Tensor) -> Any:
                n = tensor.numel() * tensor.element_size()
                count.tensors += 1
                count.bytes += n
                if isinstance(tensor, torch.nn.Parameter) or (
                        count.storages and tensor.untyped_storage().data_ptr() in count.storages):
                    count.weight_bytes += n
                return pack(tensor)

            def counted_unpack(packed: Any) -> torch.Tensor:
                count.unpacked += 1
                return unpack(packed)

            self.pack_hook, self.unpack_hook = counted_pack, counted_unpack

    return OffloadHooks()


def _pretrained(model: Any) -> Any:
    """The transformers model inside PEFT / MEFT wrappers (the first PreTrainedModel among the modules)."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    return model


def offload_checkpointed(model: Any, count: OffloadCount, cuda: bool) -> int:
    """``activation_offload: checkpointed``: transformers' offload on CUDA; on the CPU the same hooks around each
    checkpointed layer's checkpoint function (see the module doc). Returns the layers wrapped (0 on CUDA)."""
    base = _pretrained(model)
    if cuda:
        from memfit.methods.base import enable_checkpointing

        enable_checkpointing(base, offload=True)
        return 0
    wrapped = 0
    for module in base.modules():
        inner = getattr(module, "_gradient_checkpointing_func", None)
        if not getattr(module, "gradient_checkpointing", False) or inner is None:
            continue

        def func(function: Callable, *args: Any, _inner: Callable = inner, **kwargs: Any) -> Any:
            with offload_hooks(count, pin_memory=False):
                return _inner(function, *args, **kwargs)

        module._gradient_checkpointing_func = func
        wrapped += 1
    if not wrapped:
        raise ConfigError("activation_offload=checkpointed: the model has no checkpointed layer (set "
                          "strategy.gradient_checkpointing=true, or use activation_offload=all)")
    return wrapped


def tiled_mlp_forward(module: Any, original: Callable) -> Callable:
    """The tiled forward for one MLP module: DeepSpeed's TiledMLP over ``original`` (the module's own forward)."""
    import math

    import torch

    def forward(x: torch.Tensor) -> torch.Tensor:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

        if x.dim() < 2:
            return original(x)
        shards = max(1, math.ceil(x.shape[-2] / x.shape[-1]))
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            agreed = torch.tensor(shards, device=x.device)  # every rank the same tile count (ZeRO-3 gathers)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            shards = int(agreed.item())
        params = [p for p in module.parameters() if p.requires_grad]
        return TiledMLP.apply(lambda _self, tile: original(tile), module, x, shards, params)

    return forward


def install_tiled_mlp(model: Any) -> int:
    """Patch every decoder layer's ``mlp`` forward with :func:`tiled_mlp_forward`; the number patched."""
    patched = 0
    for layer in _pretrained(model).modules():
        mlp = getattr(layer, "mlp", None)
        if mlp is None or not hasattr(mlp, "forward") or getattr(mlp, "_memfit_tiled", False):
            continue
        mlp.forward = tiled_mlp_forward(mlp, mlp.forward)
        mlp._memfit_tiled = True
        patched += 1
    if not patched:
        raise ConfigError("tiled_mlp: the model has no decoder layer with an `mlp` module to tile; set "
                          "strategy.tiled_mlp=false")
    return patched


@dataclass
class Levers:
    """What :func:`install` set up for one run: the offload count and the step context (``all``)."""

    count: OffloadCount = field(default_factory=OffloadCount)
    step_context: Optional[Callable[[], Any]] = None  # entered around each training step (activation_offload=all)
    notes: list = field(default_factory=list)


def install(run: Any, model: Any) -> Levers:
    """Install the run's long-context levers on the built model (before the Trainer wraps it)."""
    import torch

    s = run.strategy
    cuda = torch.cuda.is_available()
    levers = Levers()
    if s.activation_offload != "none":
        levers.count.watch(model)
    if s.activation_offload == "checkpointed":
        offload_checkpointed(model, levers.count, cuda)
        if not cuda:
            levers.notes.append("activation_offload=checkpointed on the CPU: the checkpointed layers' inputs go "
                                "through the offload hooks (counted in metrics.jsonl's act_offload_bytes) but stay "
                                "where they are: there is no device to leave")
    elif s.activation_offload == "all":
        levers.step_context = lambda: offload_hooks(levers.count, pin_memory=cuda)
        if not cuda:
            levers.notes.append("activation_offload=all on the CPU: every saved tensor goes through the offload "
                                "hooks (counted in metrics.jsonl's act_offload_bytes) but stays where it is")
    if s.tiled_mlp:
        install_tiled_mlp(model)
    return levers


def offload_callback(levers: Levers) -> Any:
    """A TrainerCallback adding ``act_offload_bytes`` (bytes packed per optimizer step, this process) and
    ``act_offload_weight_bytes`` (of those, weights: ``save_on_cpu`` copies every weight a matmul saves) to the logs."""
    from transformers import TrainerCallback

    count = levers.count

    class OffloadBytes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            count.reset()

        def on_step_end(self, args, state, control, **kw):
            count.per_step.append((count.bytes, count.weight_bytes))

        def on_log(self, args, state, control, logs=None, **kw):
            if logs is not None and "loss" in logs and count.per_step:
                logs["act_offload_bytes"], logs["act_offload_weight_bytes"] = count.per_step[-1]

    return OffloadBytes()
