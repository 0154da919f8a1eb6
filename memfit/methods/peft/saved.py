"""What each PEFT layer type saves for backward beyond the frozen base, per wrapped module, read from the
layer's ``forward`` at the pinned peft==0.21.2 (``peft/tuners/<method>/layer.py``, line numbers of that
version). Autograd keeps a matmul's input only when the other operand has a gradient, and a product's
factor only when the other factor has one; PEFT casts a layer's input to the adapter dtype
(``_cast_input_dtype``: fp32 adapters on a 16-bit base), so an adapter that multiplies the input by a
trained matrix keeps its own fp32 copy of the input, and a delta weight built from trained factors
(``get_delta_weight``) is kept whole, in fp32, by the ``F.linear`` that applies it.

Each rule gives (bytes per token, bytes per layer) for one wrapped module ``w`` (its ``in``/``out``
features, ``count`` instances, ``params`` trained): ``x`` bytes of a value of the input as the adapter
reads it (the fp32 cast; the compute dtype where there is none), ``a`` of an adapter-path value, ``e`` of
the base's compute dtype; ``cfg`` is PEFT's config as PEFT filled it in (its defaults: VeRA's r = 256,
AdaLoRA's init_r = 12, ...).
"""

from __future__ import annotations

from typing import Any, Callable


def _input(w, cfg, a, e, x):            # the cast input, kept by a matmul with a trained matrix
    return x * w["in"], 0.0


def _input_delta(w, cfg, a, e, x):      # + the fp32 delta weight F.linear keeps for the input's gradient
    return x * w["in"], a * w["in"] * w["out"]


def _input_two_weights(w, cfg, a, e, x):  # + a second weight-sized fp32 tensor kept by the delta's own graph
    return x * w["in"], 2.0 * a * w["in"] * w["out"]


def _ia3(w, cfg, a, e, x):
    # ia3/layer.py:188-197: feedforward modules scale the input (x.to(fp32) * ia3_l keeps the fp32 input),
    # the others the output (result * ia3_l keeps the base output, in the compute dtype)
    return (x * w["in"], 0.0) if w.get("ff") else (e * w["out"], 0.0)


def _vera(w, cfg, a, e, x):
    # vera/layer.py:284-285 (pvera/layer.py the same form): lambda_b * F.linear(lambda_d * F.linear(x, A), B)
    # with A, B frozen: the products keep F.linear(x, A) (r values) and the B output (out values), fp32
    return a * (int(cfg["r"]) + w["out"]), 0.0


def _miss(w, cfg, a, e, x):
    # miss/layer.py:345-354, init_weights='bat': the base weight cast to fp32 (kept by W @ miss_block in
    # get_delta_weight:257-264) and W + delta (kept by F.linear with the cast input); else (372) the
    # block-summed input (r values) kept by its product with miss_block
    if cfg.get("init_weights") == "bat":
        return _input_two_weights(w, cfg, a, e, x)
    return a * int(cfg["r"]), 0.0


def _adalora(w, cfg, a, e, x):
    # adalora/layer.py:194-195: dropout(x) @ (A*E).T @ B.T keeps the cast input and the rank-r product
    return x * w["in"] + a * int(cfg["init_r"]), 0.0


def _road(w, cfg, a, e, x):
    # road/layer.py:182-183: the base output cast to fp32, and its rotated copy, kept by _apply_road's products
    return 2.0 * a * w["out"], 0.0


def _tinylora(w, cfg, a, e, x):
    # tinylora/layer.py:396-412: F.linear(x, A) and F.linear(h, B) with A, B frozen keep nothing of x; the
    # trained r x r R keeps its rank-r input
    return a * int(cfg["r"]), 0.0


def _osf(w, cfg, a, e, x):
    # osf/layer.py:316-350: A = cat(U_low*S_low, -U_init*S_init), B = cat(V_low, V_init) are new fp32 tensors
    # kept by x @ B.T (with the cast input) and (x @ B.T) @ A.T (with its 2r-wide input): twice the module's
    # trained factors per layer; 2r = 2 x the trained rank = 2 x params / (in + out)
    two_r = 2.0 * w["params"] / max(1, w["count"]) / max(1, w["in"] + w["out"])
    return x * w["in"] + a * two_r, 2.0 * a * w["params"] / max(1, w["count"])


def _boft(w, cfg, a, e, x):
    # boft/layer.py:604-640: the rotation is built in the input's dtype: `butterfly @ eye` keeps the in x in
    # identity, `x @ boft_rotation` keeps the input and the in x in rotation, `result * boft_scale` the output
    return e * (w["in"] + w["out"]), 2.0 * e * w["in"] * w["in"]


def _shira(w, cfg, a, e, x):
    # shira/layer.py:239-257: a dense out x in weight in the output's dtype (zeros + the sparse delta, or the
    # base weight + it) applied by F.linear, which keeps it and the input
    return e * w["in"], e * w["in"] * w["out"]


def _unilora(w, cfg, a, e, x):
    # unilora/layer.py:246-250: A, B gathered from the shared vector (fp32, r x in and out x r) kept with the
    # cast input and the rank-r product by F.linear(F.linear(x, A), B)
    r = int(cfg["r"])
    return x * w["in"] + a * r, a * r * (w["in"] + w["out"])


RULES: dict[str, Callable] = {
    "ia3.Linear": _ia3,
    "vera.Linear": _vera, "pvera.Linear": _vera,
    "loha.Linear": _input_delta,            # loha/layer.py:266-272: HadaWeight -> F.linear(x, delta_weight)
    "lokr.Linear": _input_delta,            # lokr/layer.py:336-342: make_kron(w1, w2) -> F.linear(x, delta)
    "fourierft.FourierFTLinear": _input_delta,  # fourierft/layer.py:186-188: ifft2 delta_w, F.linear(x, delta_w)
    "hira.Linear": _input_delta,            # hira/layer.py:263-267: F.linear(x, W * (B@A).T)
    "waveft.WaveFTLinear": _input_two_weights,  # waveft/layer.py:284-286; waverec2d.py:291-292 stacks the
                                                # sub-bands into one weight-sized fp32 tensor, kept by
                                                # conv_transpose2d (its backward saves its input)
    "peanut.Linear": _input_two_weights,    # peanut/layer.py:146-161, 227-229: W.t() in fp32 (kept by the
                                            # matmul with A) and the delta weight (kept by the matmul with x)
    "miss.MissLinear": _miss,
    "oft.Linear": _input,                   # oft/layer.py:653-654, 275: einsum(x, R) keeps the cast input
    "adalora.SVDLinear": _adalora,
    "road.Linear": _road,
    "tinylora.Linear": _tinylora,
    "osf.Linear": _osf,
    "boft.Linear": _boft,
    "shira.Linear": _shira,
    "unilora.Linear": _unilora,
}


# layer types whose forward builds a weight-sized delta from trained factors and applies it with a second
# F.linear(x, delta_w) beside the base layer (the RULES above, line numbers there): a GEMM of the base linear's
# shape in the adapter dtype each forward, its two in backward
DELTA_LINEAR_TYPES = frozenset({"loha.Linear", "lokr.Linear", "fourierft.FourierFTLinear", "hira.Linear",
                                "waveft.WaveFTLinear", "peanut.Linear"})


def adaption_prompt_bytes(cfg: dict, model: Any, e: float) -> tuple[float, float]:
    """(bytes per token per adapted layer, adapted layers): adaption_prompt/layer.py:183-203 recomputes the
    queries (kept by their matmul with the trained prompt's keys, compute dtype), keeps the fp32 softmax
    over the prompt's ``adapter_len`` positions, its cast (kept by the product with the trained gate) and
    that product (kept by the matmul with the prompt's values), per head."""
    n = int(cfg["adapter_len"])
    per_token = e * model.q_dim + model.heads * n * (4.0 + e + e)
    return per_token, float(min(model.layers, int(cfg["adapter_layers"])))


def saved_bytes(count: dict, model: Any, *, compute_bytes: float, adapter_bytes: float,
                cast_bytes: float) -> tuple[float, float]:
    """(bytes per token, bytes) one decoder layer's wrapped modules save, averaged over the layers; a layer
    type without a rule keeps its cast input (the common form: the input times a trained matrix)."""
    a, e, cfg = adapter_bytes, compute_bytes, count["config"]  # PEFT's config, its defaults filled in
    x = cast_bytes or e
    per_token = per_layer = 0.0
    for w in count["wrapped"]:
        rule = RULES.get(w["type"], _input)
        t, fixed = rule(w, cfg, a, e, x)
        share = w["count"] / model.layers  # instances per decoder layer
        per_token += t * share
        per_layer += fixed * share
    return per_token, per_layer
