"""MeftOptimizer: one torch optimizer a Hugging Face Trainer can drive.

``param_groups[0]`` holds every layer's CPU tables (keys, values) and ``param_groups[1]`` the
device-side router weights (if any); both carry ``lr`` etc., so LR schedulers work. ``step()``
finishes the gradient copies still in flight, runs the lazy row-wise AdamW of ``store.sparse_adamw_``
on the touched rows of each CPU table (untouched rows, their moments and step counts stay as they
are), AdamW on the router weights, then clears all MEFT gradients: the CPU gradients and touched-row
sets (the Trainer calls ``model.zero_grad()``, which does not see them) and the router's ``.grad``;
and it closes the traffic window.
Gradient accumulation: every backward adds into the CPU gradients, so the accumulation boundary is
wherever the caller calls ``step()``. The Trainer's gradient clipping sees the router only; pass
``max_grad_norm`` here to clip the CPU gradients and the router's together by their global norm.
If any gradient is not finite (fp16 overflow), the step is skipped and the gradients are discarded
(``skipped_steps`` counts them), as a GradScaler does.
Under DDP every rank holds the whole CPU store; ``step()`` averages the CPU gradients of the rows any
rank touched (an all-reduce of those rows only) before updating, so the ranks' tables stay identical.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn

from memfit.errors import ConfigError, MemfitError
from memfit.meft.model import get_context
from memfit.meft.store import dense_adamw_, sparse_adamw_


class MeftOptimizer(torch.optim.Optimizer):
    def __init__(self, model: nn.Module, lr: float = 1e-3, betas: tuple = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, max_grad_norm: Optional[float] = None):
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ConfigError(f"MEFT optimizer: max_grad_norm={max_grad_norm} must be > 0 (or None: no clipping)")
        self.max_grad_norm = max_grad_norm
        self.skipped_steps = 0
        self.last_grad_norm: Optional[float] = None
        if lr <= 0:
            raise ConfigError(f"MEFT optimizer: lr={lr} must be > 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ConfigError(f"MEFT optimizer: betas={betas} must each be in [0, 1)")
        ctx = get_context(model)
        self._ctx = ctx
        self._layers = list(ctx.layers.values())
        self._owner: dict[int, tuple] = {}
        tables: list[torch.Tensor] = []
        for a in self._layers:
            for part in ("keys", "values"):
                t = getattr(a.store, part)
                tables.append(t)
                self._owner[id(t)] = (a, part)
        routers = [a.router.weight for a in self._layers if a.router is not None]
        groups = [{"params": tables, "name": "meft_store"}]
        if routers:
            groups.append({"params": routers, "name": "meft_router"})
        super().__init__(groups, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    # ---- state -------------------------------------------------------------------------------------
    def _table_state(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        if not st:
            pin = p.is_pinned()
            st["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, pin_memory=pin)
            st["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, pin_memory=pin)
            st["row_step"] = torch.zeros(p.shape[0], dtype=torch.int64)
            a, _ = self._owner[id(p)]
            a._optimizer_bytes = getattr(a, "_optimizer_bytes", 0) + 2 * p.numel() * 4 + p.shape[0] * 8
        return st

    def _router_state(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        if not st:
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["step"] = torch.zeros((), dtype=torch.float32)
        return st

    def flush(self) -> None:
        for a in self._layers:
            if a.transfer is not None:
                a.transfer.flush()

    # ---- the step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.flush()
        self._average_across_ranks()
        if not self._check_and_clip():
            self.skipped_steps += 1
            self._consume_grads()
            return loss
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                         weight_decay=group["weight_decay"])
            for p in group["params"]:
                owner = self._owner.get(id(p))
                if owner is None:  # router weight on the device
                    if p.grad is not None:
                        st = self._router_state(p)
                        dense_adamw_(p, p.grad, st["exp_avg"], st["exp_avg_sq"], st["step"], **hyper)
                    continue
                a, part = owner
                rows = a.store.touched_rows()
                if rows.numel() == 0:
                    continue
                st = self._table_state(p)
                grad = a.store.grad_keys if part == "keys" else a.store.grad_values
                sparse_adamw_(p, grad, st["exp_avg"], st["exp_avg_sq"], st["row_step"], rows, **hyper)
        self._consume_grads()
        return loss

    def _consume_grads(self) -> None:
        # the step consumes all MEFT gradients, device ones included, so that a caller who zeroes
        # only the model's gradients (the Trainer) or none at all never re-applies them
        for a in self._layers:
            a.store.zero_grad()
            if a.router is not None:
                a.router.weight.grad = None
        self._ctx.traffic.close_step()

    def _check_and_clip(self) -> bool:
        """Global L2 norm of the touched CPU rows' and the router's gradients; False if not finite.
        With ``max_grad_norm``, scales them all so the norm is at most that."""
        squares: list[torch.Tensor] = []
        touched = []
        for a in self._layers:
            rows = a.store.touched_rows()
            touched.append(rows)
            if rows.numel():
                for grad in (a.store.grad_keys, a.store.grad_values):
                    squares.append(grad.index_select(0, rows).double().square().sum())
            if a.router is not None and a.router.weight.grad is not None:
                squares.append(a.router.weight.grad.double().square().sum().cpu())
        if not squares:
            self.last_grad_norm = 0.0
            return True
        norm = float(torch.stack(squares).sum().sqrt())
        self.last_grad_norm = norm
        if not torch.isfinite(torch.tensor(norm)):
            return False
        if self.max_grad_norm is not None and norm > self.max_grad_norm:
            scale = self.max_grad_norm / (norm + 1e-6)
            for a, rows in zip(self._layers, touched):
                if rows.numel():
                    for grad in (a.store.grad_keys, a.store.grad_values):
                        grad.index_copy_(0, rows, grad.index_select(0, rows).mul_(scale))
                if a.router is not None and a.router.weight.grad is not None:
                    a.router.weight.grad.mul_(scale)
        return True

    def _average_across_ranks(self) -> None:
        """Under torch.distributed (DDP), average the CPU gradients over ranks like DDP does for the
        device parameters: the union of every rank's touched rows is all-reduced, compactly.
        Each rank keeps a full copy of the tables; they stay equal because the updates are equal."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        world = dist.get_world_size()
        device = torch.device("cpu")
        if dist.get_backend() == "nccl":  # NCCL reduces device tensors only
            device = torch.device("cuda", torch.cuda.current_device())
        for a in self._layers:
            touched = a.store.touched.to(device=device, dtype=torch.int32)
            dist.all_reduce(touched)
            rows = touched.cpu().nonzero().flatten()
            if rows.numel() == 0:
                continue
            both = torch.cat([a.store.grad_keys.index_select(0, rows),
                              a.store.grad_values.index_select(0, rows)]).to(device)
            dist.all_reduce(both)
            both = both.cpu().div_(world)
            a.store.grad_keys.index_copy_(0, rows, both[: rows.numel()])
            a.store.grad_values.index_copy_(0, rows, both[rows.numel():])
            a.store.touched[rows] = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the router's gradients and the CPU gradients / touched rows (discarding in-flight ones)."""
        super().zero_grad(set_to_none=set_to_none)
        self.flush()
        for a in self._layers:
            a.store.zero_grad()

    def state_dict(self) -> dict:
        """Torch's optimizer state plus ``meft_tables``: the CPU key/value tables themselves.

        The tables live outside the model's state_dict (so ``model.to(device)`` and the Trainer's
        model checkpoint leave them alone); carrying them here makes the Trainer's
        checkpoint/resume restore them with their moments. Tensors only: ``weights_only`` loads work.
        """
        self.flush()
        sd = super().state_dict()
        sd["meft_tables"] = {f"{name}.{part}": getattr(a.store, part)
                             for name, a in self._ctx.layers.items() for part in ("keys", "values")}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        tables = state_dict.pop("meft_tables", None)
        if tables is not None:
            for name, a in self._ctx.layers.items():
                for part in ("keys", "values"):
                    key, dest = f"{name}.{part}", getattr(a.store, part)
                    src = tables.get(key)
                    if src is None or tuple(src.shape) != tuple(dest.shape):
                        raise MemfitError(
                            f"MEFT optimizer state: table {key!r} is missing or has another shape; "
                            "resume with the same model and meft settings as the checkpoint"
                        )
                    dest.copy_(src)
                if a.transfer is not None:
                    a.transfer.generation += 1  # device buffers no longer mirror the tables
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for p in group["params"]:
                owner = self._owner.get(id(p))
                st = self.state.get(p)
                if owner is None or not st:
                    continue
                for key in ("exp_avg", "exp_avg_sq"):
                    t = st[key].to(device="cpu", dtype=torch.float32)
                    st[key] = t.pin_memory() if p.is_pinned() and not t.is_pinned() else t.contiguous()
                st["row_step"] = st["row_step"].to(device="cpu", dtype=torch.int64)
                a, _ = owner
                a._optimizer_bytes = sum(
                    2 * t.numel() * 4 + t.shape[0] * 8 for t in (a.store.keys, a.store.values)
                    if self.state.get(t))


def build_meft_optimizer(model: nn.Module, lr: float = 1e-3, betas: Iterable[float] = (0.9, 0.999),
                         eps: float = 1e-8, weight_decay: float = 0.0,
                         max_grad_norm: Optional[float] = None) -> MeftOptimizer:
    """The optimizer for a model prepared by add_meft (pass it to ``Trainer(optimizers=(opt, sched))``).

    ``max_grad_norm``: clip the CPU tables' and router's gradients together (None: no clipping)."""
    return MeftOptimizer(model, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         max_grad_norm=max_grad_norm)
