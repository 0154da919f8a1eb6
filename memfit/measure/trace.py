"""An estimate from a traced step: the real model, optimizer and loss run under ``FakeTensorMode``.

No weights are read and nothing is computed: every tensor is a fake of the right shape, dtype and
device, so a step of any architecture transformers can build from its ``config.json`` is traced in
seconds, and a small tracker of live tensor storages (weak references, the same accounting as the CPU
allocator) gives the step's peak. It checks and extends the analytical activation counts for
architectures the estimator does not know. It reproduces the kernels this machine would run (on a
CPU-only torch build: CPU SDPA and eager attention; a fake CUDA device is not available there).

Supported: full and LoRA, gradient checkpointing, eager / SDPA, fp32 / bf16 / mixed precision,
AdamW / SGD. Not traced: QLoRA (bitsandbytes kernels), MEFT, sharded engines.
"""

from __future__ import annotations

import contextlib
import weakref
from pathlib import Path
from typing import Any

from memfit.errors import IncompatibleError, MemfitError


def config_path(model: str) -> Path:
    """A model folder, a config.json, a memfit preset name or a Hub id (owner/name[@revision], fetched
    into the HF cache) → its config.json (memfit.spec.model.config_file; a Hub id's failures keep their own
    line)."""
    from memfit.errors import ConfigError
    from memfit.spec.model import config_file, hub_id

    try:
        return config_file(model)
    except ConfigError:
        if hub_id(model) is not None:
            raise
        raise MemfitError(f"model: {model!r} is neither a folder with config.json, a config.json, a preset, "
                          "nor a Hub id (owner/name)") from None


class LiveStorageTracker:
    """Bytes of distinct tensor storages alive, and their peak, counted as ops create them."""

    def __init__(self) -> None:
        self.live: dict[int, Any] = {}
        self.current = 0
        self.peak = 0

    def track(self, t: Any) -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self.live:
            return
        n = st.nbytes()

        def gone(_ref: Any, key: int = key, n: int = n) -> None:
            if self.live.pop(key, None) is not None:
                self.current -= n

        self.live[key] = weakref.ref(st, gone)
        self.current += n
        self.peak = max(self.peak, self.current)

    def mode(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_map_only

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tree_map_only(torch.Tensor, tracker.track, out)
                return out

        return _Mode()


def _to_fake(net: Any, fake: Any) -> None:
    """Replace meta parameters/buffers by fake CPU tensors (shared ones stay shared)."""
    import torch

    device = torch.device("cpu")
    seen: dict[int, Any] = {}  # keyed by the (long-lived) module tensors, so tied weights stay tied
    keep = []

    def conv(t: Any) -> Any:
        return fake.fake_tensor_converter.from_meta_and_device(fake, t.detach(), device)

    for mod in net.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                if id(p) not in seen:
                    seen[id(p)] = torch.nn.Parameter(conv(p), requires_grad=p.requires_grad)
                    keep.append(p)
                mod._parameters[name] = seen[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None:
                if id(b) not in seen:
                    seen[id(b)] = conv(b)
                    keep.append(b)
                mod._buffers[name] = seen[id(b)]


@contextlib.contextmanager
def _unpacked_inputs():
    """transformers cannot read fake position ids, so it assumes packed sequences and materialises an
    s×s mask that the real run (full-length, unpadded rows) never builds. The traced inputs are never
    packed: say so, and SDPA keeps ``is_causal`` as in the real step."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda *a, **k: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _load_and_autocast_dtypes(s: Any) -> tuple[Any, Any]:
    """(dtype the weights are loaded in, autocast dtype or None): the trainer's own choice
    (:func:`memfit.methods.base.load_dtypes`), so the trace loads e.g. LoRA's frozen base in bf16 under
    bf16-mixed."""
    import torch

    from memfit.methods.base import load_dtypes

    load, compute = load_dtypes(s, cuda=torch.cuda.is_available())
    return load, (compute if s.precision.endswith("-mixed") else None)


def check_traceable(s: Any) -> None:
    """IncompatibleError for what the trace does not cover (plain Python: callable before any torch)."""
    from memfit.methods import METHODS

    if not METHODS[s.method].traced:
        traced = " and ".join(n for n, m in METHODS.items() if m.traced)
        raise IncompatibleError(f"traced estimate: method {s.method} is not traced ({traced} are)")
    if s.zero_stage or s.fsdp:
        raise IncompatibleError("traced estimate: sharded engines are not traced; use zero_stage=0, fsdp=false")
    if s.attention == "fa2":
        raise IncompatibleError("traced estimate: fa2 cannot be traced on this torch build; use sdpa")
    if s.optimizer not in ("adamw", "sgd"):
        raise IncompatibleError(f"traced estimate: optimizer {s.optimizer} is not traced (adamw, sgd are)")


def traced_step(model: str, strategy: Any) -> dict[str, Any]:
    """The traced peak of one training step (after a step that created the optimizer state)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoConfig, AutoModelForCausalLM

    from memfit.methods import METHODS

    s = strategy
    check_traceable(s)
    cfg = AutoConfig.from_pretrained(str(config_path(model)))
    cfg._attn_implementation = s.attention
    weight_dtype, autocast = _load_and_autocast_dtypes(s)
    # Build (and wrap with peft) on the meta device, then swap every parameter and buffer for a fake
    # CPU tensor of the same shape: no memory, no init compute, and peft's module moves stay on meta.
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(cfg, dtype=weight_dtype)
    if s.gradient_checkpointing:
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if s.loss == "chunked":  # as memfit.train.model.build_model does
        from memfit.train.loss import install_chunked_loss

        install_chunked_loss(net)
    method = METHODS[s.method]
    if hasattr(method, "peft_config"):  # the trainer's own LoraConfig (targets matched in one place)
        from peft import get_peft_model

        from memfit.methods.lora import model_linear_names

        lora_cfg = method.peft_config(s, model_linear_names(net))
        with torch.device("meta"):
            net = get_peft_model(net, lora_cfg)
        if s.gradient_checkpointing:
            net.enable_input_require_grads()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    _to_fake(net, fake)
    tracker = LiveStorageTracker()
    with fake, _unpacked_inputs():
        net.train()
        params = [p for p in net.parameters() if p.requires_grad]
        if s.optimizer == "sgd":
            opt = torch.optim.SGD(params, lr=1e-4, momentum=0.9)
        else:  # adamw (check_traceable refused the rest)
            opt = torch.optim.AdamW(params, lr=1e-4)
        ids = torch.randint(0, cfg.vocab_size, (s.micro_batch_size, s.seq_len))

        def step() -> None:
            for _ in range(s.grad_accum):
                ctx = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
                with ctx:  # like the Trainer's compute_loss: only the loss outlives the forward
                    loss = net(input_ids=ids, labels=ids).loss
                loss.backward()
                del loss
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # creates the optimizer state
        for p in net.parameters():
            tracker.track(p)
        for b in net.buffers():
            tracker.track(b)
        for st in opt.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    tracker.track(v)
        tracker.track(ids)
        start = tracker.current
        tracker.peak = start
        with tracker.mode():
            step()
    return {"peak_bytes": int(tracker.peak), "model_states_bytes": int(start),
            "method": "FakeTensorMode trace (live storages)", "config": str(config_path(model))}
