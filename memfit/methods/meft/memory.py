"""MEFT's torch-free geometry for the estimator: what memfit.meft allocates and moves (its Transfer
counters are the reference). The one copy: memfit.estimate reads it through the method registry.

``profile`` is memfit.estimate's Profile (``meft_buffer_fraction``, ``meft_param_transfer_bytes``,
``meft_live_buffers``, ``checkpoint_extra_layers``). Experts follow MeftConfig with its default
``expert_factor`` = 1 (a Strategy has no such key): ``auto`` = ceil(sqrt(neurons)).
"""

from __future__ import annotations

import math
from typing import Any, Optional


def meft_buffer_rows(neurons: int, top_k: int, profile: Any, buffer_size: Optional[int] = None) -> float:
    """Rows of each layer's fixed device buffers (memfit.meft's buffer_size, strategy.meft_buffer_size):
    when unset max(top_k, ceil(neurons x ``meft_buffer_fraction``)); capped at the neurons."""
    if buffer_size:
        return float(min(neurons, buffer_size))
    return float(min(neurons, max(top_k, math.ceil(neurons * profile.meft_buffer_fraction))))


def meft_rows(model: Any, neurons: int, top_k: int, b: int, s: int, profile: Any,
              buffer_size: Optional[int] = None) -> float:
    """Distinct adapter rows (β·K) a micro-batch activates per layer: the top-K union over b·s tokens,
    capped by the device buffer (:func:`meft_buffer_rows`)."""
    return float(min(meft_buffer_rows(neurons, top_k, profile, buffer_size), top_k * b * s))


def meft_experts(neurons: int, experts) -> int:
    """Key experts requested: ceil(sqrt(neurons)) for ``auto`` (MeftConfig.requested_experts, expert_factor 1)."""
    return int(math.ceil(math.sqrt(neurons))) if experts == "auto" else int(experts)


def meft_traffic_bytes(model: Any, strategy: Any, profile: Any) -> dict[str, float]:
    """MEFT bytes per process per optimizer step, as memfit.meft's Transfer counts them. Per layer and
    forward pass (twice with gradient checkpointing: the recomputation routes and loads again):
    ``d2h`` the hidden states (b·s·d, activation dtype) and the probed expert ids (b·s·n_probe int64);
    ``h2d`` the key rows and value rows (2·d·β·K in the buffer dtype), the tokens' buffer positions
    (b·s·K int32) and the row ids (β·K int64). Per layer in backward, ``d2h``: the slice gradients
    (2·d·β·K, buffer dtype), and with checkpointing one more load of the rows (``h2d``). β·K = rows the
    micro-batch activates (see :func:`meft_rows`). Checked against memfit.meft's counters (tiny Llama, CPU)."""
    p = profile
    b, s, ga = strategy.micro_batch_size, strategy.seq_len, strategy.grad_accum
    e = 4.0 if strategy.precision == "fp32" else 2.0
    e_buf = p.meft_param_transfer_bytes or e
    rows = meft_rows(model, strategy.meft_neurons, strategy.meft_top_k, b, s, p, strategy.meft_buffer_size)
    router = meft_experts(strategy.meft_neurons, strategy.meft_experts) > 1
    d, tokens = model.hidden, float(b) * s
    passes = 2.0 if strategy.gradient_checkpointing else 1.0
    slices = 2.0 * d * rows * e_buf
    h2d = passes * (slices + tokens * strategy.meft_top_k * 4.0 + (rows * 8.0 if router else 0.0))
    if passes > 1:  # backward runs the first forward's plan; the recomputation refilled the buffers: reload
        h2d += slices
    d2h = passes * (tokens * d * e + (tokens * strategy.meft_n_probe * 8.0 if router else 0.0)) + slices
    return {"h2d": h2d * model.layers * ga, "d2h": d2h * model.layers * ga}


def meft_memory(model: Any, st: Any, p: Any, e: float, on_cpu: bool) -> tuple[float, float, float, float]:
    """(device bytes incl. saved adapter tensors, of which saved for backward, host bytes, rows used)."""
    b, s, gc = st.micro_batch_size, st.seq_len, st.gradient_checkpointing
    # memfit.meft: per layer, fixed device buffers for key and value rows (in the buffer dtype)
    # + what its autograd function saves: the FFN input x, the activations (b·s × β·K)
    # and with a router the gates (fp32) and the router's fp32 copy of x
    e_buf = p.meft_param_transfer_bytes or e
    buf_rows = meft_buffer_rows(st.meft_neurons, st.meft_top_k, p, st.meft_buffer_size)
    rows = meft_rows(model, st.meft_neurons, st.meft_top_k, b, s, p, st.meft_buffer_size)
    router = meft_experts(st.meft_neurons, st.meft_experts) > 1
    h = model.hidden
    per_tok = e * h + rows * e_buf + ((4.0 * rows + (4.0 * h if e != 4.0 else 0.0)) if router else 0.0)
    held = p.checkpoint_extra_layers if gc else model.layers
    meft_acts = held * b * s * per_tok
    meft_buf = (p.meft_live_buffers or model.layers) * buf_rows * h * 2.0 * e_buf + meft_acts
    # host side: W_K, W_V + gradients + 2 Adam moments in fp32 (16 B per adapter value), the row
    # bookkeeping (touched flag, two int64 Adam step counters per neuron) and four staging tables
    # (slices and their gradients) of buffer_rows x h per layer
    meft_host = model.layers * (st.meft_neurons * (2.0 * h * 16.0 + 17.0) + 4.0 * buf_rows * h * e_buf)
    if on_cpu:  # the "device" is this RAM: the store is part of what the allocator holds
        meft_buf += meft_host
        meft_host = 0.0
    return meft_buf, meft_acts, meft_host, rows
