"""The CPU side of one MEFT layer: key and value tables, their gradients, and a lazy row-wise Adam.

Layout: ``keys`` and ``values`` are both (neurons x hidden) float32, one row per neuron, so the rows
of a batch's active neurons are gathered and scattered contiguously (``values`` row i is column i of
the paper's W_V). Gradients are dense CPU tables filled by ``index_add_``; ``touched`` marks the rows
that received gradient since the last optimizer step.

Update semantics (``sparse_adamw_``): lazy AdamW, like ``torch.optim.SparseAdam`` but with a step
counter per row. A row that was not touched in a step is left exactly as it was: its weight is not
decayed and its moments are not decayed, and its step counter does not advance, so its bias
correction is that of a row that has seen ``row_step`` updates.
"""

from __future__ import annotations

from typing import Optional

import torch


def _empty(rows: int, cols: int, pin: bool) -> torch.Tensor:
    return torch.zeros(rows, cols, dtype=torch.float32, pin_memory=pin)


class CpuStore:
    """W_K and W_V of one layer in CPU memory, with their gradients and the touched-row mask."""

    def __init__(self, neurons: int, hidden: int, pin: bool = False):
        self.neurons = neurons
        self.hidden = hidden
        self.pin = pin
        self.keys = _empty(neurons, hidden, pin)
        self.values = _empty(neurons, hidden, pin)
        self.grad_keys = _empty(neurons, hidden, pin)
        self.grad_values = _empty(neurons, hidden, pin)
        self.touched = torch.zeros(neurons, dtype=torch.bool)

    # ---- gradients -----------------------------------------------------------------------------
    def accumulate(self, rows: torch.Tensor, grad_keys: torch.Tensor, grad_values: torch.Tensor) -> None:
        """Scatter slice gradients (len(rows) x hidden, any float dtype) into the CPU gradients."""
        if rows.numel() == 0:
            return
        self.grad_keys.index_add_(0, rows, grad_keys.to(torch.float32))
        self.grad_values.index_add_(0, rows, grad_values.to(torch.float32))
        self.touched[rows] = True

    def touched_rows(self) -> torch.Tensor:
        return self.touched.nonzero().flatten()

    def zero_grad(self) -> None:
        rows = self.touched_rows()
        if rows.numel():
            self.grad_keys.index_fill_(0, rows, 0.0)
            self.grad_values.index_fill_(0, rows, 0.0)
        self.touched.zero_()

    # ---- accounting ----------------------------------------------------------------------------
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (self.keys, self.values, self.grad_keys, self.grad_values, self.touched))


def sparse_adamw_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    row_step: torch.Tensor,
    rows: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """AdamW on ``rows`` of a (rows x cols) table, in place; other rows are not read or written."""
    if rows.numel() == 0:
        return
    g = grad.index_select(0, rows)
    m = exp_avg.index_select(0, rows).mul_(beta1).add_(g, alpha=1.0 - beta1)
    v = exp_avg_sq.index_select(0, rows).mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    step = row_step.index_select(0, rows).add_(1)
    bc1 = 1.0 - torch.pow(beta1, step.to(torch.float64)).to(torch.float32)
    bc2 = 1.0 - torch.pow(beta2, step.to(torch.float64)).to(torch.float32)
    p = param.index_select(0, rows)
    if weight_decay:
        p.mul_(1.0 - lr * weight_decay)
    denom = (v / bc2.unsqueeze(1)).sqrt_().add_(eps)
    p.addcdiv_(m, denom * bc1.unsqueeze(1), value=-lr)
    param.index_copy_(0, rows, p)
    exp_avg.index_copy_(0, rows, m)
    exp_avg_sq.index_copy_(0, rows, v)
    row_step.index_copy_(0, rows, step)


def dense_adamw_(
    param: torch.Tensor,
    grad: Optional[torch.Tensor],
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """Plain AdamW for the small device-side router weights (``step`` is a 0-d float tensor)."""
    if grad is None:
        return
    step.add_(1)
    t = float(step.item())
    if weight_decay:
        param.mul_(1.0 - lr * weight_decay)
    exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    bc1 = 1.0 - beta1 ** t
    bc2 = 1.0 - beta2 ** t
    denom = (exp_avg_sq / bc2).sqrt_().add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bc1)

