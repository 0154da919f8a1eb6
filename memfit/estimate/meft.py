"""MEFT in the estimate: what memfit.meft allocates and moves (its Transfer counters are the reference)."""

from __future__ import annotations

from typing import Optional

from memfit.estimate import memory as M
from memfit.estimate.constants import DEFAULT_PROFILE, Profile
from memfit.spec.model import ModelSpec
from memfit.spec.strategy import Strategy


def meft_traffic_bytes(model: ModelSpec, strategy: Strategy, profile: Optional[Profile] = None) -> dict[str, float]:
    """MEFT bytes per process per optimizer step, as memfit.meft's Transfer counts them. Per layer and
    forward pass (twice with gradient checkpointing: the recomputation routes and loads again):
    ``d2h`` the hidden states (b·s·d, activation dtype) and the probed expert ids (b·s·n_probe int64);
    ``h2d`` the key rows and value rows (2·d·β·K in the buffer dtype), the tokens' buffer positions
    (b·s·K int32) and the row ids (β·K int64). Per layer in backward, ``d2h``: the slice gradients
    (2·d·β·K, buffer dtype), and with checkpointing one more load of the rows (``h2d``). β·K = rows the
    micro-batch activates (see memory.meft_rows). Checked against memfit.meft's counters (tiny Llama, CPU)."""
    p = profile or DEFAULT_PROFILE
    b, s, ga = strategy.micro_batch_size, strategy.seq_len, strategy.grad_accum
    e = 4.0 if strategy.precision == "fp32" else 2.0
    e_buf = p.meft_param_transfer_bytes or e
    rows = M.meft_rows(model, strategy.meft_neurons, strategy.meft_top_k, b, s, p)
    router = M.meft_experts(strategy.meft_neurons, strategy.meft_experts) > 1
    d, tokens = model.hidden, float(b) * s
    passes = 2.0 if strategy.gradient_checkpointing else 1.0
    slices = 2.0 * d * rows * e_buf
    h2d = passes * (slices + tokens * strategy.meft_top_k * 4.0 + (rows * 8.0 if router else 0.0))
    if passes > 1:  # backward runs the first forward's plan; the recomputation refilled the buffers: reload
        h2d += slices
    d2h = passes * (tokens * d * e + (tokens * strategy.meft_n_probe * 8.0 if router else 0.0)) + slices
    return {"h2d": h2d * model.layers * ga, "d2h": d2h * model.layers * ga}


def meft_memory(model: ModelSpec, st: Strategy, p: Profile, e: float, on_cpu: bool) -> tuple[float, float, float, float]:
    """(device bytes incl. saved adapter tensors, of which saved for backward, host bytes, rows used)."""
    b, s, gc = st.micro_batch_size, st.seq_len, st.gradient_checkpointing
    # memfit.meft: per layer, fixed device buffers for key and value rows (in the buffer dtype)
    # + what its autograd function saves: the FFN input x, the activations (b·s × β·K)
    # and with a router the gates (fp32) and the router's fp32 copy of x
    e_buf = p.meft_param_transfer_bytes or e
    buf_rows = M.meft_buffer_rows(st.meft_neurons, st.meft_top_k, p)
    rows = M.meft_rows(model, st.meft_neurons, st.meft_top_k, b, s, p)
    router = M.meft_experts(st.meft_neurons, st.meft_experts) > 1
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
