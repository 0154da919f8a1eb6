"""Chunked linear + cross-entropy: the causal-LM loss without the full ``[tokens, vocab]`` logits.

``strategy.loss = "chunked"``: the output projection and the cross-entropy run over chunks of
``loss_chunk_tokens(vocab, tokens)`` tokens (memfit.spec.strategy), each under non-reentrant
``torch.utils.checkpoint``: the forward keeps only the chunk's summed loss, and backward recomputes the
chunk's logits before differentiating them. At any moment one chunk's logits, fp32 log-softmax and
gradients exist instead of the whole micro-batch's.

The numbers are transformers' ``ForCausalLMLoss`` (transformers/loss/loss_utils.py, 5.24): labels padded
with ``-100`` and shifted by one (or ``shift_labels`` as given), logits upcast to fp32, cross-entropy with
``ignore_index``, summed and divided by ``num_items_in_batch`` when the Trainer passes it (the count of
non-masked targets over all micro-batches of the accumulation step, gathered across ranks), else the mean
over the non-masked targets. The Trainer's own scaling (``/ grad_accum`` when no count is passed, ``x world
size`` with ``average_tokens_across_devices``) stays outside the model, untouched.

The head is called as a module (``lm_head(h)``), so DeepSpeed ZeRO-3 gathers its weight in its hooks and
FSDP, DDP, PEFT and tied embeddings see the same parameter use as the standard path. The model's own forward
is replaced on the instance only, before PEFT/engine wrapping, and only when labels are given; without
labels (generation, logits wanted) the original forward runs.
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
    ``final_logit_softcapping``. None when it does nothing."""
    steps: list[Callable[[torch.Tensor], torch.Tensor]] = []
    scaling = getattr(config, "logits_scaling", None)
    if scaling not in (None, 1, 1.0):
        steps.append(lambda x, c=float(scaling): x / c)
    scale = getattr(config, "logit_scale", None)
    if isinstance(scale, (int, float)) and scale != 1:
        steps.append(lambda x, c=float(scale): x * c)
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        steps.append(lambda x, c=float(cap): torch.tanh(x / c) * c)
    if not steps:
        return None

    def post(x: torch.Tensor) -> torch.Tensor:
        for step in steps:
            x = step(x)
        return x

    return post


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
    # split, not slicing: one SplitBackward concatenates the chunks' hidden-state gradients (a slice's
    # backward would allocate a zero-filled [tokens, hidden] tensor per chunk)
    for h, t in zip(flat_h.split(step), target.split(step)):
        if torch.is_grad_enabled() and (h.requires_grad or any(p.requires_grad for p in head.parameters())):
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
