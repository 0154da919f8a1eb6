"""Chunked linear + cross-entropy: the causal-LM loss without the full ``[tokens, vocab]`` logits.

``strategy.loss = "chunked"``: the output projection and the cross-entropy run over chunks of
``loss_chunk_tokens(vocab, tokens)`` tokens (memfit.spec.strategy). Two paths, chosen per call:

- fused (:class:`_FusedLinearCE`, the idea of Liger Kernel's fused linear cross-entropy): the forward makes
  each chunk's fp32 logits, its loss, and at once the gradients (softmax − one-hot through the model's
  logit post-processing, then times the head weight for the hidden states and, when the head trains,
  accumulated into the head weight's gradient). It keeps only the hidden-state gradient [tokens, hidden]
  and the head's gradient; backward scales them. No logits are recomputed: the head's matmuls are the
  standard path's, the gradient ones moved into the forward.
- recomputing: each chunk under non-reentrant ``torch.utils.checkpoint``, its logits recomputed in
  backward (one more head forward). For a head the fused path cannot read directly (DeepSpeed ZeRO-3's
  partitioned weights, FSDP2's DTensor shards, PEFT or a quantized layer on the head, module hooks) and
  for a post-processing it cannot differentiate by hand; without grad (eval) the chunks run plainly.

At any moment one chunk's logits, fp32 log-softmax and gradients exist instead of the whole micro-batch's.

The numbers are transformers' ``ForCausalLMLoss`` (transformers/loss/loss_utils.py, 5.24): labels padded
with ``-100`` and shifted by one (or ``shift_labels`` as given), logits upcast to fp32, cross-entropy with
``ignore_index``, summed and divided by ``num_items_in_batch`` when the Trainer passes it (the count of
non-masked targets over all micro-batches of the accumulation step, gathered across ranks), else the mean
over the non-masked targets. The Trainer's own scaling (``/ grad_accum`` when no count is passed, ``x world
size`` with ``average_tokens_across_devices``) stays outside the model, untouched.

On the recomputing path the head is called as a module (``lm_head(h)``), so DeepSpeed ZeRO-3 gathers its
weight in its hooks; the fused path takes the head's weight (and bias) as inputs of one autograd Function,
so DDP's and FSDP2's gradient hooks, PEFT and tied embeddings see the same gradient arrive on the same
parameter. The model's own forward is replaced on the instance only, before PEFT/engine wrapping, and only
when labels are given; without labels (generation, logits wanted) the original forward runs.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memfit.errors import IncompatibleError
from memfit.spec.strategy import loss_chunk_tokens

IGNORE_INDEX = -100


def head_postprocess(config: Any) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """What a model's forward does to the logits after ``lm_head`` (read from its config): Granite divides by
    ``logits_scaling``, Cohere multiplies by ``logit_scale``, Gemma-2/3 soft-cap with
    ``final_logit_softcapping``. None when it does nothing. The callable's ``steps`` lists the same steps as
    ``("scale", c)`` (x * c) and ``("softcap", c)`` (tanh(x / c) * c): what :class:`_FusedLinearCE`
    differentiates by hand."""
    steps: list[tuple[str, float]] = []
    scaling = getattr(config, "logits_scaling", None)
    if scaling not in (None, 1, 1.0):
        steps.append(("divide", float(scaling)))
    scale = getattr(config, "logit_scale", None)
    if isinstance(scale, (int, float)) and scale != 1:
        steps.append(("scale", float(scale)))
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        steps.append(("softcap", float(cap)))
    if not steps:
        return None

    def post(x: torch.Tensor) -> torch.Tensor:
        for kind, c in steps:
            if kind == "divide":
                x = x / c
            elif kind == "scale":
                x = x * c
            else:
                x = torch.tanh(x / c) * c
        return x

    post.steps = tuple(steps)
    return post


def _post_steps(post) -> Optional[tuple]:
    """The elementwise steps of ``post`` the fused path differentiates by hand: () for none, None when
    ``post`` is some other callable (then the recomputing path runs)."""
    if post is None:
        return ()
    steps = getattr(post, "steps", None)
    if not isinstance(steps, tuple) or any(k not in ("divide", "scale", "softcap") for k, _ in steps):
        return None
    if any(k == "softcap" for k, _ in steps[:-1]):  # the hand derivative assumes nothing after the cap
        return None
    return steps


class _FusedLinearCE(torch.autograd.Function):
    """Sum over non-ignored targets of ``cross_entropy(post(h @ W.T + b).float(), target)``, its gradients
    computed in the forward, chunk by chunk (the idea of Liger Kernel's fused linear cross-entropy): per
    chunk the fp32 logits, the loss, softmax − one-hot (zero rows for ``ignore_index``) through the
    post-processing's derivative, then ``grad_h = grad_logits @ W`` and ``grad_W += grad_logits.T @ h``.
    Only ``grad_h`` [tokens, hidden] (in the hidden states' dtype) and, when the head trains, ``grad_W``
    (and ``grad_b``) are kept; backward scales them by the incoming gradient. No logits are recomputed."""

    @staticmethod
    def forward(ctx, h, weight, bias, target, step, ignore_index, steps, compute_dtype):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        cd = compute_dtype
        # one cast of the head for all chunks (under autocast F.linear would cast it per chunk)
        w = weight if weight.dtype == cd else weight.to(cd)
        b = None if bias is None else (bias if bias.dtype == cd else bias.to(cd))
        grad_h = torch.empty(h.shape, dtype=h.dtype, device=h.device) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        with torch.autocast(h.device.type, enabled=False):
            for start in range(0, h.shape[0], step):
                hc = h[start:start + step]
                hc = hc if hc.dtype == cd else hc.to(cd)
                t = target[start:start + step]
                x = F.linear(hc, w, b).float()  # the chunk's logits, upcast as ForCausalLMLoss does
                factor, cap = 1.0, None
                for kind, c in steps:  # post-processing in place, as head_postprocess computes it
                    if kind == "divide":
                        x.div_(c)
                        factor /= c
                    elif kind == "scale":
                        x.mul_(c)
                        factor *= c
                    else:
                        x.div_(c).tanh_().mul_(c)
                        cap = c  # d/dx tanh(x/c)*c = 1 - (y/c)^2, y the capped value (softcap is last)
                valid = t != ignore_index
                tv = torch.where(valid, t, 0).unsqueeze(1)
                lse = torch.logsumexp(x, dim=1)
                picked = x.gather(1, tv).squeeze(1)
                total += torch.where(valid, lse - picked, 0.0).sum()
                if not (need_h or need_w or need_b):
                    continue
                if cap is not None:
                    deriv = x.div(cap).square_().neg_().add_(1.0)  # 1 - (y/c)^2, from the capped logits
                    if factor != 1.0:
                        deriv.mul_(factor)
                else:
                    deriv = None
                g = x.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place of the logits
                g.scatter_add_(1, tv, valid.to(g.dtype).neg().unsqueeze(1))  # - one-hot
                g.masked_fill_(~valid.unsqueeze(1), 0.0)
                if deriv is not None:
                    g.mul_(deriv)
                    del deriv
                elif factor != 1.0:
                    g.mul_(factor)
                gc = g if g.dtype == cd else g.to(cd)
                if need_h:
                    if grad_h.dtype == cd:
                        torch.mm(gc, w, out=grad_h[start:start + step])
                    else:
                        grad_h[start:start + step].copy_(torch.mm(gc, w))
                if need_w:
                    if grad_w.dtype == cd:
                        grad_w.addmm_(gc.t(), hc)
                    else:
                        grad_w.add_(torch.mm(gc.t(), hc))
                if need_b:
                    grad_b.add_(g.sum(0).to(grad_b.dtype))
                del x, g, gc
        ctx.grads = (grad_h, grad_w, grad_b)
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        grads = ctx.grads
        if grads is None:
            raise RuntimeError("memfit's fused chunked loss: backward ran twice (retain_graph) through the same "
                               "forward; its stored gradients are scaled in place and can be used once")
        ctx.grads = None
        grad_h, grad_w, grad_b = (None if x is None else x.mul_(grad_out.to(x.device)) for x in grads)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _fused_ok(head: torch.nn.Module, post) -> bool:
    """Whether the fused path can read the head's weight itself. Not for a head whose forward is not
    nn.Linear's (PEFT/LoRA on the head, quantized heads), nor one with module hooks (someone expects to see
    the call), nor where the weight is not a plain local tensor: DeepSpeed ZeRO-3 partitions parameters
    (``ds_id``; size 0 outside its gather hooks, which only run when the module is called) and FSDP2 keeps
    DTensor shards; those keep the recomputing path, whose ``head(h)`` call goes through the engine's hooks.
    (FSDP2 puts plain unsharded parameters on the modules of a unit for its forward: the fused path then
    reads those, and their gradient reaches FSDP's reduce-scatter as F.linear's would.)"""
    if _post_steps(post) is None or type(head).forward is not torch.nn.Linear.forward:
        return False
    if head._forward_hooks or head._forward_pre_hooks:
        return False
    for p in (head.weight, head.bias):
        if p is None:
            continue
        if hasattr(p, "ds_id") or p.numel() == 0 or type(p) not in (torch.nn.Parameter, torch.Tensor):
            return False
        if type(p.data) is not torch.Tensor:  # DTensor or another tensor subclass
            return False
    return True


def _compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(h, weight)`` produces: autocast's where it is on, else the weight's."""
    kind = h.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return weight.dtype


def _chunk_loss_sum(head: torch.nn.Module, post, ignore_index: int, h: torch.Tensor,
                    target: torch.Tensor) -> torch.Tensor:
    logits = head(h)
    if post is not None:
        logits = post(logits)
    return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction="sum")


def chunked_causal_lm_loss(hidden: torch.Tensor, head: torch.nn.Module, labels: Optional[torch.Tensor],
                           num_items_in_batch: Any = None, ignore_index: int = IGNORE_INDEX,
                           shift_labels: Optional[torch.Tensor] = None, chunk: Optional[int] = None,
                           post: Optional[Callable] = None, vocab: Optional[int] = None) -> torch.Tensor:
    """``ForCausalLMLoss(head(hidden), labels, ...)`` computed ``chunk`` tokens at a time.

    ``hidden`` [batch, seq, hidden] (the decoder's last hidden state), ``head`` the output projection
    module, ``post`` what the model does to its logits after the head (:func:`head_postprocess`).
    """
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    target = shift_labels.reshape(-1).to(hidden.device)
    if vocab is None:
        vocab = int(getattr(head, "out_features", 0) or head.weight.shape[0])
    step = chunk or loss_chunk_tokens(vocab, flat_h.shape[0])
    total = None
    needs_grad = torch.is_grad_enabled() and (flat_h.requires_grad or any(p.requires_grad for p in head.parameters()))
    if needs_grad and _fused_ok(head, post):  # no recomputation: each chunk's gradients made in the forward
        total = _FusedLinearCE.apply(flat_h, head.weight, head.bias, target, step, ignore_index,
                                     _post_steps(post), _compute_dtype(flat_h, head.weight))
    else:
        # the recomputing path (eval, ZeRO-3 / FSDP2 heads, PEFT on the head, other post-processing): split,
        # not slicing: one SplitBackward concatenates the chunks' hidden-state gradients (a slice's
        # backward would allocate a zero-filled [tokens, hidden] tensor per chunk)
        for h, t in zip(flat_h.split(step), target.split(step)):
            if needs_grad:
                part = checkpoint(_chunk_loss_sum, head, post, ignore_index, h, t, use_reentrant=False)
            else:
                part = _chunk_loss_sum(head, post, ignore_index, h, t)
            total = part if total is None else total + part
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    return total / (target != ignore_index).sum()  # the mean over non-masked targets (0/0 = nan, as torch)


def _decoder_and_head(model) -> tuple[torch.nn.Module, torch.nn.Module]:
    decoder = getattr(model, getattr(model, "base_model_prefix", ""), None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(decoder, torch.nn.Module) or decoder is model or not isinstance(head, torch.nn.Module):
        raise IncompatibleError(f"strategy.loss=chunked: {type(model).__name__} has no separate decoder and "
                                "output layer to chunk; use strategy.loss=standard")
    return decoder, head


def install_chunked_loss(model, chunk: Optional[int] = None) -> None:
    """Make ``model`` (a transformers ``*ForCausalLM``, before PEFT/engine wrapping) compute its loss in
    chunks whenever labels are given. Raises IncompatibleError for a model whose loss is not
    transformers' causal-LM cross-entropy."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    if getattr(model, "_memfit_chunked_loss", False):
        return
    loss_fn = getattr(model, "loss_function", None)
    if getattr(loss_fn, "__func__", loss_fn) is not ForCausalLMLoss:
        raise IncompatibleError(f"strategy.loss=chunked: {type(model).__name__}'s loss is not transformers' "
                                "causal-LM cross-entropy (ForCausalLMLoss); use strategy.loss=standard")
    decoder, head = _decoder_and_head(model)
    post = head_postprocess(model.config)
    vocab = int(model.config.get_text_config().vocab_size)
    original = model.forward

    def forward(*args, labels=None, shift_labels=None, **kwargs):
        if (labels is None and shift_labels is None) or args or kwargs.get("logits_to_keep"):
            if shift_labels is not None:
                kwargs["shift_labels"] = shift_labels
            return original(*args, labels=labels, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        num_items = kwargs.pop("num_items_in_batch", None)
        ignore_index = kwargs.pop("ignore_index", IGNORE_INDEX)
        kwargs.pop("logits_to_keep", None)
        kwargs.pop("return_dict", None)
        out = decoder(**kwargs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        loss = chunked_causal_lm_loss(hidden, head, labels, num_items, ignore_index, shift_labels, chunk,
                                      post, vocab)
        return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=getattr(out, "hidden_states", None),
                                      attentions=getattr(out, "attentions", None))

    forward.__wrapped__ = original  # inspect.signature sees the model's own (**kwargs: loss kwargs accepted)
    model.forward = forward
    model._memfit_chunked_loss = True
