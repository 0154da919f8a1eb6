"""The MEFT adapter of one FFN: out = FFN(x) + W_V . relu(select_topK(W_K . x)).

Per call (all tokens of the batch flattened to N x d):
1. (router) scores d -> E on the device, top ``n_probe`` experts per token;
2. x (and the probed expert ids) are copied to the CPU; on CUDA this copy is started before the FFN
   runs and the FFN's compute overlaps with it and with step 3 (look-ahead within the layer);
3. the CPU finds each token's top-K neurons and the batch union (capped by the buffer size), and
   copies those key rows and value rows into the fixed device buffers;
4. ``SparseAdapterFn`` computes the adapter on the device with the small slices; its backward computes
   the input gradient and the slice gradients, which go back to the CPU and are index_add'ed into
   the CPU gradient tables.
With a router the activation of a neuron is gate(expert) * relu(key . x), where gate = n_probe *
softmax over the token's probed experts' router scores (1 on average); the router learns through it.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import torch
from torch import nn

from memfit.meft.config import MeftConfig
from memfit.meft.router import KeyExpertsRouter, batch_union, brute_force_topk, key_experts_topk
from memfit.meft.store import CpuStore
from memfit.meft.transfer import Traffic, Transfer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LayerStats(NamedTuple):
    tokens: int
    union: int
    keys_scored: int
    dropped: int


class _Plan(NamedTuple):
    rows: torch.Tensor  # CPU long (u,)
    generation: int


class SparseAdapterFn(torch.autograd.Function):
    """relu(x K_u^T) * mask [* gate] @ V_u with K_u, V_u the device buffers' first u rows.

    Inputs: x (N x d), mask (N x u, 0/1, device), gate (N x u or None), anchor (a leaf that requires
    grad, so the output is differentiable even when nothing below the adapter is), the adapter and the
    plan (which rows the buffers hold). Slice gradients go to the CPU store, not to autograd.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mask: torch.Tensor, gate: Optional[torch.Tensor],
                anchor: torch.Tensor, adapter: "MeftAdapter", plan: _Plan) -> torch.Tensor:
        u = plan.rows.numel()
        keys, values = adapter.transfer.buf_keys[:u], adapter.transfer.buf_values[:u]
        with torch.autocast(device_type=x.device.type, enabled=False):
            xb = x.to(keys.dtype)
            act = torch.relu(xb @ keys.T) * mask
            a = act * gate.to(keys.dtype) if gate is not None else act
            out = a @ values
        ctx.save_for_backward(x, act, gate)
        ctx.adapter, ctx.plan = adapter, plan
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        x, act, gate = ctx.saved_tensors
        adapter, plan = ctx.adapter, ctx.plan
        u = plan.rows.numel()
        if adapter.transfer.generation != plan.generation:
            # the buffers were refilled by another forward of this layer since: load our rows again
            adapter.transfer.load_rows(adapter.store.keys, adapter.store.values, plan.rows)
        keys, values = adapter.transfer.buf_keys[:u], adapter.transfer.buf_values[:u]
        with torch.autocast(device_type=x.device.type, enabled=False):
            g = grad_out.to(keys.dtype)
            xb = x.to(keys.dtype)
            g_a = g @ values.T
            g_gate = None
            if gate is not None:
                gb = gate.to(keys.dtype)
                g_gate = (g_a * act).to(gate.dtype) if ctx.needs_input_grad[2] else None
                a = act * gb
                g_a = g_a * gb
            else:
                a = act
            g_values = a.T @ g
            g_h = g_a * (act > 0)
            g_x = (g_h @ keys).to(x.dtype) if ctx.needs_input_grad[0] else None
            g_keys = g_h.T @ xb
        adapter.transfer.push_grads(adapter.store, plan.rows, g_keys, g_values)
        return g_x, None, g_gate, None, None, None


class MeftAdapter(nn.Module):
    """One layer's adapter: CPU store, optional device router, device buffers (made on first use)."""

    def __init__(self, hidden: int, config: MeftConfig, traffic: Traffic, pin: bool):
        super().__init__()
        self.hidden = hidden
        self.config = config
        self.traffic = traffic
        self.store = CpuStore(config.neurons, hidden, pin=pin)
        self.router = KeyExpertsRouter(hidden, config.num_experts) if config.uses_router else None
        self.transfer: Optional[Transfer] = None
        self.last_stats: Optional[LayerStats] = None
        self._pin = pin
        self._pending_state: Optional[dict] = None
        self._hooks: tuple = ()
        # a leaf that requires grad, so the adapter output is differentiable under a frozen base model
        self._anchor = torch.zeros((), requires_grad=True)

    # ---- initialisation ----------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, ffn_rows: Optional[torch.Tensor], generator: torch.Generator) -> None:
        r, d = self.store.keys.shape
        if ffn_rows is not None and ffn_rows.shape[1] == d:
            # the FFN's own rows first; beyond them random rows of the same spread (repeating rows
            # would make neurons with identical keys and gradients, which never become different)
            rows = ffn_rows.float().cpu()[:r]
            self.store.keys[: rows.shape[0]].copy_(rows)
            if rows.shape[0] < r:
                extra = torch.randn(r - rows.shape[0], d, generator=generator) * rows.std()
                self.store.keys[rows.shape[0]:].copy_(extra)
        else:
            bound = 1.0 / math.sqrt(d)
            self.store.keys.copy_(torch.rand(r, d, generator=generator) * 2 * bound - bound)
        self.store.values.zero_()
        if self.router is not None:
            self.router.init_from_keys(self.store.keys, self.config.expert_size)

    # ---- device buffers ----------------------------------------------------------------------------
    def _buffers_for(self, x: torch.Tensor) -> Transfer:
        dtype = x.dtype if self.config.buffer_dtype == "auto" else _DTYPES[self.config.buffer_dtype]
        if not dtype.is_floating_point:
            dtype = torch.float32
        t = self.transfer
        if t is None or t.device != x.device or t.dtype != dtype:
            if t is not None:
                t.flush()
            self.transfer = Transfer(self.config.buffer_rows, self.hidden, x.device, dtype,
                                     self.traffic, self._pin)
        return self.transfer

    # ---- the two halves of a call --------------------------------------------------------------------
    def begin(self, x: torch.Tensor) -> dict:
        """Route on the device and start copying x (and the probed experts) to the CPU."""
        transfer = self._buffers_for(x)
        flat = x.reshape(-1, self.hidden)
        state: dict = {"flat": flat, "shape": x.shape}
        if self.router is not None:
            scores = self.router(flat)
            top_val, top_idx = scores.topk(self.config.probes, dim=1)
            state["top_val"], state["top_idx"] = top_val, top_idx
            state["idx_host"], state["idx_event"] = transfer.to_host(top_idx)
        state["x_host"], state["x_event"] = transfer.to_host(flat)
        return state

    def finish(self, state: dict) -> torch.Tensor:
        """CPU retrieval, slice upload, and the device computation; returns the adapter's output."""
        cfg, transfer, flat = self.config, self.transfer, state["flat"]
        transfer.wait_host(state["x_event"])
        x_host = state["x_host"].float()
        if self.router is not None:
            transfer.wait_host(state["idx_event"])
            sel = key_experts_topk(x_host, self.store.keys, state["idx_host"], cfg.expert_size, cfg.top_k)
        else:
            sel = brute_force_topk(x_host, self.store.keys, cfg.top_k)
        union = batch_union(sel.neurons, cfg.buffer_rows)
        u = union.rows.numel()
        generation = transfer.load_rows(self.store.keys, self.store.values, union.rows)
        local = transfer.to_device(union.local).long()
        n = flat.shape[0]
        dtype = transfer.dtype
        mask = torch.zeros(n, u + 1, dtype=dtype, device=flat.device).scatter_(1, local, 1.0)[:, :u]
        gate = None
        if self.router is not None:
            rows_dev = transfer.to_device(union.rows)
            probs = torch.softmax(state["top_val"], dim=1) * self.config.probes
            dense = torch.zeros(n, cfg.num_experts, dtype=probs.dtype, device=flat.device)
            dense = dense.scatter(1, state["top_idx"], probs)
            gate = dense.index_select(1, rows_dev // cfg.expert_size)
        self.last_stats = LayerStats(n, u, sel.keys_scored, union.dropped)
        self.traffic.note("keys_scored", sel.keys_scored)
        self.traffic.note("dropped", union.dropped)
        out = SparseAdapterFn.apply(flat, mask, gate, self._anchor, self,
                                    _Plan(union.rows, generation))
        return out.reshape(state["shape"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(self.begin(x))

    def device_bytes(self) -> int:
        buffers = self.transfer.device_bytes() if self.transfer is not None else 0
        router = self.router.weight.numel() * 4 if self.router is not None else 0
        return buffers + router


def attach(ffn: nn.Module, adapter: MeftAdapter) -> None:
    """Put ``adapter`` beside ``ffn``: ffn's output becomes ffn(x) + adapter(x).

    Done with forward hooks and a child module named ``meft``, so the base model's parameter names
    (and its state_dict keys) do not change. The pre-hook starts the copy of x to the CPU before the
    FFN runs, so on CUDA the FFN's compute overlaps with that copy and with the CPU retrieval.
    """
    ffn.meft = adapter

    def _pre(module: nn.Module, args: tuple) -> None:
        adapter._pending_state = adapter.begin(args[0])

    def _post(module: nn.Module, args: tuple, output: Any) -> Any:
        state, adapter._pending_state = adapter._pending_state, None
        if isinstance(output, tuple):  # e.g. MoE blocks that return (hidden, router_logits)
            return (output[0] + adapter.finish(state),) + output[1:]
        return output + adapter.finish(state)

    adapter._hooks = (ffn.register_forward_pre_hook(_pre), ffn.register_forward_hook(_post))
