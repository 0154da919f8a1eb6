"""The work each PEFT layer type does beyond its base layer, per wrapped module, for the time model — its GEMMs,
bytes, host ops, syncs and uploads, read from the layer's ``forward`` at the pinned peft==0.21.2
(``peft/tuners/<method>/layer.py``, line numbers of that version), as :mod:`~memfit.methods.peft.saved` reads
what they keep. A type without a rule adds no GEMM of its own here; every wrapped linear gets LoRA's
elementwise and host work (``GENERIC_OPS``, below). ``weight_bytes`` here are forward + backward.

Each rule gives, for one wrapped module ``w`` (``in``/``out`` features, ``count`` instances, ``params``
trained; ``cfg`` PEFT's config with its defaults filled in):

- ``linears``: ((in, out, in the adapter dtype, weight trains), ...): products with every token, priced as a
  linear (forward, input gradient, and the weight gradient when it trains);
- ``weight_gemms``: ((m, n, k, forward count, backward count), ...): products of weight-sized matrices,
  whatever the tokens;
- ``weight_bytes``: memory-bound bytes per forward + backward whatever the tokens;
- ``kernels``: (forward, backward) small kernels whose cost is their launch, not their work (BOFT's per-block
  copies), each at the Profile's ``gemm_kernel_seconds``;
- ``token_bytes``: (forward, backward) memory-bound bytes per token beyond LoRA's (e.g. C3A's FFTs of the input);
- ``upload_bytes``: host bytes converted and copied to the device per forward, waited for (BOFT's boft_P);
- ``ops``: host ops beyond the type's counted ones (a config the count did not run, e.g. MiSS's 'bat');
- ``syncs``: host synchronisations per forward + backward (a blocking upload, a ``nonzero``): the device
  drains and waits for the host's next launch, each at the host's time of one kernel.

Every wrapped module also gets its type's host ops beyond LoRA's, counted (``host_ops.json``, written by
bench/peft_host_ops.py: the kernels its forward + backward launch, in module-level ops).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

from memfit.methods.base import LayerWork
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
    # The permutation buffer boft_P (1 x in x in fp32, layer.py:362) is not an adapter tensor, so it stays on
    # the CPU: `self.boft_P.to(x)` (layer.py:627) converts it to the input's dtype on the host and copies it up,
    # pageable, every forward -- 4 + 2 B read and written on the host, 2 B over the link -- and waits for the
    # copy; torch.linalg.solve's error check (the Cayley transform, layer.py:466) syncs once more
    k, factors = float(w["in"]), int(cfg.get("boft_n_butterfly_factor") or 1)
    size = int(cfg.get("boft_block_size") or 0)
    blocks = int(cfg.get("boft_block_num") or 0) or (int(k) // size if size else 0)
    return {"linears": ((k, k, False, True),), "weight_gemms": ((k, k, k, 3.0 * factors, 4.0 * factors - 1.0),),
            "kernels": (blocks + 1.0, 1.0), "upload_bytes": 8.0 * k * k, "syncs": 2.0}


def _randlora(w: dict, cfg: dict) -> dict:
    # randlora/layer.py forward:327-344, get_scaled_bases:262-308: F.linear(F.linear(x, first), second) of full
    # rank r x ceil(min(in, out) / r) in the adapter dtype; the shared random bases are frozen and only the one on
    # the smaller side is scaled by the trained lambda / gamma (its weight gradient)
    # UniqueBaseGrad (layer.py:30-48, 303): lambda * A * gamma materialised (12 B per basis value forward),
    # each einsum's gradient product (24 B backward), over rank x min(in, out) values
    k, n, r = float(w["in"]), float(w["out"]), int(cfg["r"])
    rank = float(r * math.ceil(min(k, n) / r))
    return {"linears": ((k, rank, True, k <= n), (rank, n, True, k > n)), "weight_bytes": 36.0 * rank * min(k, n)}


def _loha(w: dict, cfg: dict) -> dict:
    # loha/layer.py HadaWeight:366-386: (w1a @ w1b) * (w2a @ w2b) * scale each forward: two n x r x k fp32
    # products, six in the backward (the two recomputed, four gradients); ~76 B per weight value beyond the
    # delta linear's 12 (the products' outputs, the Hadamard products with the gradient, their reads)
    k, n, r = float(w["in"]), float(w["out"]), float(cfg.get("r") or 1)
    return {**_delta(w, cfg), "weight_gemms": ((n, k, r, 2.0, 6.0),), "weight_bytes": 88.0 * k * n}


def _gralora(w: dict, cfg: dict) -> dict:
    # gralora/layer.py forward:362-379: LoRA's products as block-diagonal batched matmuls (rank r, the same
    # FLOPs), an fp32 reshape copy of the output, its cast and scale in bf16: 14 n bytes per token forward,
    # 6 n + 8 k backward beyond the generic cast and add
    k, n, r = float(w["in"]), float(w["out"]), float(cfg.get("r") or 1)
    return {"linears": ((k, r, True, True), (r, n, True, True)), "token_bytes": (14.0 * n, 6.0 * n + 8.0 * k)}


def _osf(w: dict, cfg: dict) -> dict:
    # osf/layer.py forward:316-350: F.linear(F.linear(x, B), A), A and B the trained factors concatenated with
    # their frozen initial copies: rank 2r (2r from the trained count, as saved._osf reads it), adapter dtype
    k, n = float(w["in"]), float(w["out"])
    two_r = 2.0 * w["params"] / max(1, w["count"]) / max(1.0, k + n)
    return {"linears": ((k, two_r, True, True), (two_r, n, True, True))}


def _fourierft(w: dict, cfg: dict) -> dict:
    # fourierft/layer.py get_delta_weight:94-101 each forward: zeros, scatter of the n_frequency spectrum, the
    # real -> complex64 copy, cuFFT's ifft2 (~2 passes of 16 B), its 1/(k n) normalisation, .real x scaling:
    # ~76 B per weight value; the backward mirrors it (scale, .real's backward, fft2, normalisation): ~72 B.
    # The spectrum's indices live in a plain dict on the CPU (not moved with the module), so every forward
    # uploads them with a blocking copy: one host sync
    return {**_delta(w, cfg), "weight_bytes": 148.0 * float(w["in"]) * float(w["out"]), "syncs": 1.0}


def _waveft(w: dict, cfg: dict) -> dict:
    # waveft/layer.py get_delta_weight:124-199 + waverec2d.py: zeros, the four sub-bands stacked, the
    # inverse wavelet's conv_transpose2d, x scaling (~28 B per weight value); the backward: the quadrant slices'
    # slice_backward (zeros + copy each), their sum, the conv's input gradient (~100 B). Host syncs: the
    # indices' blocking upload (layer.py:126), two boolean-mask gathers (nonzero: a device-to-host count,
    # layer.py:161-162), the wavelet filters built on the CPU each call and copied up (wavelet.py:55-61, four),
    # and the backward's masked index_put (one more nonzero): 8 per module
    return {**_delta(w, cfg), "weight_bytes": 128.0 * float(w["in"]) * float(w["out"]), "syncs": 8.0}


def _c3a(w: dict, cfg: dict) -> dict:
    # c3a/layer.py forward:192-199 + utils.py BlockCircularConvolution: no delta weight; the input's length-b
    # FFTs, three batched complex GEMMs of 8 T k n / b FLOPs (forward, the input's and the kernel's gradients:
    # as a fp32 linear k -> 4 n / b), FFTs of their outputs, the input's FFT recomputed in the backward, and
    # bmm's contiguous operand copies: 54 k + 48 n bytes per token forward, 88 k + 78 n backward, less the
    # cast / scale / add every wrapped linear is priced for (GENERIC: 6 k + 10 n, 12 k + 4 n)
    k, n, b = float(w["in"]), float(w["out"]), float(cfg.get("block_size") or 1)
    return {"linears": ((k, 4.0 * n / b, True, True),), "token_bytes": (48.0 * k + 38.0 * n, 76.0 * k + 74.0 * n)}


def _oft(w: dict, cfg: dict) -> dict:
    # oft/layer.py (0.16+: the input is rotated, not the weight) OFTRotationModule: the Cayley-Neumann rotation of
    # r blocks of b x b rebuilt every forward (_cayley_batch:132-147: three batched b^3 products; six in the
    # backward), x rotated block by block (forward:277: one (r, T, b) x (r, b, b) bmm, two in the backward: a
    # k -> b linear's three), the permuted result copied (8 B per input value each way); ~76 passes of the
    # r x b x b fp32 blocks (zeros, index_put, repeat, the products' outputs), forward + backward
    k = float(w["in"])
    b = float(cfg.get("oft_block_size") or 0) or k / max(1.0, float(cfg.get("r") or 1))
    return {"linears": ((k, b, True, True),), "weight_gemms": ((k, b, b, 3.0, 6.0),),
            "weight_bytes": 76.0 * 4.0 * k * b, "token_bytes": (8.0 * k, 8.0 * k)}


def _miss(w: dict, cfg: dict) -> dict:
    # miss/layer.py MissLinear.forward:340-374. 'bat': the whole merged weight rebuilt in fp32 every forward
    # (clone, cast, the r x r block products W.permute @ miss + miss: n k r multiply-adds each way, the permuted
    # copies), then F.linear(x, merged) in fp32 -- the base GEMMs run in fp32 and the weight gets a gradient
    # (an fp32 linear k -> n with its weight gradient); ~92 B per weight value forward + backward, ~6 more
    # kernels. Default / mini: x summed over k / r groups, then an fp32 (T x r) @ (r x n) product
    k, n, r = float(w["in"]), float(w["out"]), float(cfg.get("r") or 1)
    if cfg.get("init_weights") == "bat":
        return {"linears": ((k, n, True, True),), "weight_gemms": ((n, k, r, 1.0, 1.0),),
                "weight_bytes": 92.0 * k * n, "ops": 6.0 / kernels_per_op()}
    return {"linears": ((r, n, True, True),), "token_bytes": (4.0 * k, 16.0 * k)}


def _psoft(w: dict, cfg: dict) -> dict:
    # psoft/layer.py forward:469-481: fp32 x @ A (k -> r, A frozen), @ R (r x r, trained through Q), @ B (r -> n,
    # frozen); R from Q each forward (256^3: negligible work) -- by torch.linalg.solve unless use_cayley_neumann,
    # whose error check syncs the host (L157-160); xr - xa, the scale: 12 r + 8 n bytes per token forward,
    # 20 r + 22 n + 6 k backward
    k, n, r = float(w["in"]), float(w["out"]), float(cfg.get("r") or 1)
    out = {"linears": ((k, r, True, False), (r, r, True, True), (r, n, True, False)),
           "token_bytes": (12.0 * r + 8.0 * n, 20.0 * r + 22.0 * n + 6.0 * k)}
    return out if cfg.get("use_cayley_neumann") else {**out, "syncs": 1.0}


def _lily(w: dict, cfg: dict) -> dict:
    # lily/layer.py forward:170-177: fp32 x @ A (k -> r, A shared by stride_A layers), a router over num_B
    # experts, their B combined (an einsum reading num_B r n, writing r n, both ways), @ B (r -> n); the shared
    # A's and B's gradients accumulated across layers: ~(36 num_B + 16) r n + 16 r k bytes per forward +
    # backward; 8 n + 8 r per token forward, 6 k + 12 n + 8 r backward beyond the generic casts
    k, n, r, e = float(w["in"]), float(w["out"]), float(cfg.get("r") or 1), float(cfg.get("num_B") or 2)
    return {"linears": ((k, r, True, True), (r, n, True, True)),
            "weight_bytes": (36.0 * e + 16.0) * r * n + 16.0 * r * k,
            "token_bytes": (8.0 * n + 8.0 * r, 6.0 * k + 12.0 * n + 8.0 * r)}


def _vblora(w: dict, cfg: dict) -> dict:
    # vblora/layer.py _get_lora_matrices:187-215 rebuilds A and B from the bank each forward (topk, softmax,
    # gather, weighted sum: counted in host_ops.json); line 192 tests the logits with .isinf().any() in an
    # `if`: a device-to-host read, one host sync per module and forward
    return {"syncs": 1.0}


def _adalora(w: dict, cfg: dict) -> dict:
    # adalora/layer.py SVDLinear.forward:175-197: x @ (A * E)^T @ B^T at init_r -- the rank allocator masks E,
    # it never shrinks the factors (model.py:359's resize is commented out) -- fp32 adapters; the allocator
    # (model.py update_and_allocate, RankAllocator: EMA of |p * grad| per tensor, the budget mask with a
    # .tolist() per module) runs once per optimizer step outside autograd: its kernels are counted
    # (host_ops.json step_ops) but not priced -- a no-grad op's host cost on a GPU host is not measured
    k, n, r = float(w["in"]), float(w["out"]), float(cfg.get("init_r") or cfg.get("r") or 1)
    return {"linears": ((k, r, True, True), (r, n, True, True))}


def _rank_pair(trains: bool, second: float = 1.0) -> Callable:
    """LoRA's form at the config's rank r in the adapter dtype, F.linear(F.linear(x, A), B): VeRA's and PVeRA's
    frozen shared projections (vera/layer.py:285, pvera/layer.py:316-317: PVeRA's B takes the r / 2 mean half),
    UniLoRA's A and B built from its trained vector (unilora/layer.py:250), DeLoRA's trained A and B
    (delora/layer.py:249-259); ``second``: B's input width over r."""
    def rule(w: dict, cfg: dict) -> dict:
        k, n, r = float(w["in"]), float(w["out"]), float(cfg.get("r") or 1)
        return {"linears": ((k, r, True, trains), (r * second, n, True, trains))}
    return rule


RULES: dict[str, Callable] = {**{t: _delta for t in DELTA_LINEAR_TYPES}, "loha.Linear": _loha,
                              "gralora.Linear": _gralora, "boft.Linear": _boft,
                              "randlora.Linear": _randlora, "osf.Linear": _osf,
                              "fourierft.FourierFTLinear": _fourierft, "waveft.WaveFTLinear": _waveft,
                              "c3a.C3ALinear": _c3a, "oft.Linear": _oft, "miss.MissLinear": _miss,
                              "psoft.Linear": _psoft, "lily.Linear": _lily, "vblora.Linear": _vblora,
                              "adalora.SVDLinear": _adalora, "vera.Linear": _rank_pair(False),
                              "pvera.Linear": _rank_pair(False, 0.5), "unilora.Linear": _rank_pair(True),
                              "delora.DeloraLinear": _rank_pair(True)}


def _adaption_prompt(cfg: dict, model) -> tuple[dict, float]:
    """(the work, adapted layers): per adapted layer (adaption_prompt/layer.py AdaptedAttention.forward:151-223,
    utils.py:72-93): after the attention, q_proj again on the hidden states (and v_proj, unused: position_embeddings
    are passed), the prompt's keys and values (k_proj, v_proj on adapter_len positions), scores and output against them
    per head (fp32 softmax, the gate), o_proj on the result; all in the compute dtype (the prompt is not upcast).
    Bytes: ~34 h + 28 H L forward per token, 44 h + 40 H L backward; 24 + 30 kernels."""
    h, q, kv, heads, n = model.hidden, model.q_dim, model.kv_dim, model.heads, float(cfg["adapter_len"])
    work = {"linears": ((h, q, False, False), (h, kv / 2.0, False, False), (q, h, False, False),
                        (q, 2.0 * n, False, True)),
            "weight_gemms": ((n, kv, h, 2.0, 2.0),),
            "token_bytes": (34.0 * h + 28.0 * heads * n, 44.0 * h + 40.0 * heads * n),
            "ops": 54.0 / kernels_per_op()}
    return work, float(min(model.layers, int(cfg.get("adapter_layers") or model.layers)))


# types that wrap no linear (adaption prompt's attention layers): (cfg, model) -> (work, adapted layers)
TYPE_RULES: dict[str, Callable] = {"ADAPTION_PROMPT": _adaption_prompt}


# Every wrapped linear, whatever its type: PEFT's tuner layers run the base layer, cast the input to the
# adapter's dtype (BaseTunerLayer._cast_input_dtype: fp32 adapters on a 16-bit base), apply their dropout, and
# scale and add (or multiply) their result into the base's output — LoRA's work beyond its GEMMs
# (memfit.steptime.work.lora_elementwise_bytes) and its host ops: cast, dropout, the adapter, scale, add, ~6
GENERIC_OPS = 6.0
HOST_OPS_FILE = Path(__file__).with_name("host_ops.json")  # bench/peft_host_ops.py: each type's ops beyond these
_HOST_OPS: dict = {}


def kernels_per_op() -> float:
    """Kernel launches per module-level host op (LoRA's wrapper: its counted kernels / GENERIC_OPS)."""
    host_ops("")
    return float(_HOST_OPS.get("", {}).get("unit", 2.25))


def host_ops(peft_type: str) -> float:
    """Module-level host ops a wrapped module of ``peft_type`` runs beyond LoRA's ``GENERIC_OPS``, forward +
    backward, as bench/peft_host_ops.py counted them (0 for a type it did not count; never below
    -GENERIC_OPS)."""
    if not _HOST_OPS:
        data = json.loads(HOST_OPS_FILE.read_text()) if HOST_OPS_FILE.is_file() else {}
        _HOST_OPS.update(data.get("types", {}), **{"": {"unit": data.get("unit_kernels_per_op", 2.25)}})
    return max(-GENERIC_OPS, float(_HOST_OPS.get(peft_type, {}).get("ops", 0.0)))


def layer_work(count: dict, model) -> LayerWork:
    """``Method.extra_layer_work`` for method=peft: per decoder layer, ``delta_linears`` (in, out, instances,
    in the adapter dtype, weight trains), ``weight_gemms`` (m, n, k, forward, backward, instances),
    ``weight_bytes`` and ``kernels`` from the type's rule, and for every wrapped linear its LoRA-like
    elementwise work (``lora_like``: (in, out, instances); ``dropout``: the config has one) and host ``ops``,
    from PEFT's count of the wrapped modules (memfit.methods.peft.count)."""
    layers, kind, cfg = model.layers, count.get("peft_type", ""), count["config"]
    linears, gemms, nbytes, kf, kb, tf, tb, syncs, upload = [], [], 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    ops = host_ops(kind) * sum(w["count"] for w in count["wrapped"]) / layers
    generic = [(float(w["in"]), float(w["out"]), w["count"] / layers) for w in count["wrapped"]
               if w.get("in") and w.get("out")]
    done = [(RULES[w["type"]](w, cfg), w["count"] / layers) for w in count["wrapped"] if w["type"] in RULES]
    if kind in TYPE_RULES:
        got, adapted = TYPE_RULES[kind](cfg, model)
        done.append((got, adapted / layers))
    for got, share in done:  # share: instances per decoder layer
        linears += [(k, n, share, adapter_dtype, trains) for k, n, adapter_dtype, trains in got.get("linears", ())]
        gemms += [(*g, share) for g in got.get("weight_gemms", ())]
        nbytes += got.get("weight_bytes", 0.0) * share
        fwd, bwd = got.get("kernels", (0.0, 0.0))
        kf, kb = kf + fwd * share, kb + bwd * share
        fwd, bwd = got.get("token_bytes", (0.0, 0.0))
        tf, tb = tf + fwd * share, tb + bwd * share
        syncs += got.get("syncs", 0.0) * share
        upload += got.get("upload_bytes", 0.0) * share
        ops += got.get("ops", 0.0) * share
    lora_like = tuple(generic)
    dropout = bool(generic) and any(key.endswith("dropout") and isinstance(v, (int, float)) and v > 0
                                    for key, v in cfg.items())
    if generic:
        ops += GENERIC_OPS * sum(share for _, _, share in generic)
    # each sync at the host's time of one kernel launch, in module-level ops
    return LayerWork(weight_bytes=nbytes, token_forward_bytes=tf, token_backward_bytes=tb, ops=ops,
                     delta_linears=tuple(linears), weight_gemms=tuple(gemms), kernels=(kf, kb),
                     upload_bytes=upload, sync_ops=syncs / kernels_per_op() if syncs else 0.0,
                     lora_like=lora_like, dropout=dropout)
