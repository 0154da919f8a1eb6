"""The GEMMs each PEFT layer type runs beyond its base layer, per wrapped module, for the time model — read
from the layer's ``forward`` at the pinned peft==0.21.2 (``peft/tuners/<method>/layer.py``, line numbers of that
version), as :mod:`~memfit.methods.peft.saved` reads what they keep. A type without a rule adds no GEMM of its
own here; every wrapped linear gets LoRA's elementwise and host work (``GENERIC_OPS``, below).

Each rule gives, for one wrapped module ``w`` (``in``/``out`` features, ``count`` instances, ``params``
trained; ``cfg`` PEFT's config with its defaults filled in):

- ``linears``: ((in, out, in the adapter dtype, weight trains), ...): products with every token, priced as a
  linear (forward, input gradient, and the weight gradient when it trains);
- ``weight_gemms``: ((m, n, k, forward count, backward count), ...): products of weight-sized matrices,
  whatever the tokens;
- ``weight_bytes``: memory-bound bytes per forward whatever the tokens;
- ``kernels``: (forward, backward) small kernels whose cost is their launch, not their work (BOFT's per-block
  copies), each at the Profile's ``gemm_kernel_seconds``.
"""

from __future__ import annotations

import math
from typing import Callable

from memfit.methods.peft.saved import DELTA_LINEAR_TYPES


def _delta(w: dict, cfg: dict) -> dict:
    # the delta-weight methods (saved.DELTA_LINEAR_TYPES, line numbers there): a weight-sized delta applied by a
    # second F.linear(x, delta_w) beside the base layer, in the adapter dtype; the delta is written in the
    # forward, its gradient written and read back into the factors' in the backward: 3 x 4 B per value
    k, n = float(w["in"]), float(w["out"])
    return {"linears": ((k, n, True, True),), "weight_bytes": 12.0 * k * n}


def _boft(w: dict, cfg: dict) -> dict:
    # boft/layer.py Linear.forward:594-650: an in x in rotation built from the butterfly blocks each forward:
    # bmm(block_diag, P.T) and bmm(P, .) per butterfly factor, N - 1 chained products, @ eye (3N GEMMs in the
    # input's dtype; 4N - 1 in backward, every product with a trained operand), then x @ rotation.
    # Without PEFT's fbd_cuda extension (JIT-built with ninja and nvcc at first use, layer.py:77-102; on failure
    # the butterfly factor drops to 1, layer.py:283-291) the block diagonal is torch.block_diag(*unbind(R))
    # (layer.py:621-624): ATen's block_diag (native/TensorShape.cpp) zero-fills the in x in result, then copies
    # each H x H block with its own slice().slice().copy_() -- a small kernel per block; its backward only
    # slices (views) and unbind's backward stacks the blocks' gradients (one cat)
    k, factors = float(w["in"]), int(cfg.get("boft_n_butterfly_factor") or 1)
    size = int(cfg.get("boft_block_size") or 0)
    blocks = int(cfg.get("boft_block_num") or 0) or (int(k) // size if size else 0)
    return {"linears": ((k, k, False, True),), "weight_gemms": ((k, k, k, 3.0 * factors, 4.0 * factors - 1.0),),
            "kernels": (blocks + 1.0, 1.0)}


def _randlora(w: dict, cfg: dict) -> dict:
    # randlora/layer.py forward:327-344, get_scaled_bases:262-308: F.linear(F.linear(x, first), second) of full
    # rank r x ceil(min(in, out) / r) in the adapter dtype; the shared random bases are frozen and only the one on
    # the smaller side is scaled by the trained lambda / gamma (its weight gradient)
    k, n, r = float(w["in"]), float(w["out"]), int(cfg["r"])
    rank = float(r * math.ceil(min(k, n) / r))
    return {"linears": ((k, rank, True, k <= n), (rank, n, True, k > n))}


def _osf(w: dict, cfg: dict) -> dict:
    # osf/layer.py forward:316-350: F.linear(F.linear(x, B), A), A and B the trained factors concatenated with
    # their frozen initial copies: rank 2r (2r from the trained count, as saved._osf reads it), adapter dtype
    k, n = float(w["in"]), float(w["out"])
    two_r = 2.0 * w["params"] / max(1, w["count"]) / max(1.0, k + n)
    return {"linears": ((k, two_r, True, True), (two_r, n, True, True))}


RULES: dict[str, Callable] = {**{t: _delta for t in DELTA_LINEAR_TYPES}, "boft.Linear": _boft,
                              "randlora.Linear": _randlora, "osf.Linear": _osf}


# Every wrapped linear, whatever its type: PEFT's tuner layers run the base layer, cast the input to the
# adapter's dtype (BaseTunerLayer._cast_input_dtype: fp32 adapters on a 16-bit base), apply their dropout, and
# scale and add (or multiply) their result into the base's output — LoRA's work beyond its GEMMs
# (memfit.steptime.work.lora_elementwise_bytes) and its host ops: cast, dropout, the adapter, scale, add, ~6
GENERIC_OPS = 6.0


def layer_work(count: dict, layers: int) -> dict:
    """``Method.extra_layer_work`` for method=peft: per decoder layer, ``delta_linears`` (in, out, instances,
    in the adapter dtype, weight trains), ``weight_gemms`` (m, n, k, forward, backward, instances),
    ``weight_bytes`` and ``kernels`` from the type's rule, and for every wrapped linear its LoRA-like
    elementwise work (``lora_like``: (in, out, instances); ``dropout``: the config has one) and host ``ops``,
    from PEFT's count of the wrapped modules (memfit.methods.peft.count)."""
    linears, gemms, nbytes, kf, kb = [], [], 0.0, 0.0, 0.0
    generic = [(float(w["in"]), float(w["out"]), w["count"] / layers) for w in count["wrapped"]
               if w.get("in") and w.get("out")]
    for w in count["wrapped"]:
        rule = RULES.get(w["type"])
        if rule is None:
            continue
        share = w["count"] / layers  # instances per decoder layer
        got = rule(w, count["config"])
        linears += [(k, n, share, adapter_dtype, trains) for k, n, adapter_dtype, trains in got.get("linears", ())]
        gemms += [(*g, share) for g in got.get("weight_gemms", ())]
        nbytes += got.get("weight_bytes", 0.0) * share
        fwd, bwd = got.get("kernels", (0.0, 0.0))
        kf, kb = kf + fwd * share, kb + bwd * share
    out: dict = {}
    if linears:
        out["delta_linears"] = tuple(linears)
    if gemms:
        out["weight_gemms"] = tuple(gemms)
    if nbytes:
        out["weight_bytes"] = nbytes
    if kf or kb:
        out["kernels"] = (kf, kb)
    if generic:
        cfg = count["config"]
        out["lora_like"] = tuple(generic)
        out["dropout"] = any(key.endswith("dropout") and isinstance(v, (int, float)) and v > 0
                             for key, v in cfg.items())
        out["ops"] = GENERIC_OPS * sum(share for _, _, share in generic)
    return out
