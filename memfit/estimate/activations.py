"""Activation memory of a decoder layer: what autograd saves, and what one layer's backward adds.

Derived from the Hugging Face blocks and checked tensor by tensor against a traced step
(``memfit.measure.trace``, FakeTensorMode; saved tensors listed per autograd node). The rules:

- A linear saves its input only if its weight is trained (full fine-tuning) or it carries a LoRA adapter
  that reads the same tensor (no ``lora_dropout``, no PEFT dtype cast: otherwise the adapter saves its
  own copy, counted in ``lora_intermediates``). A frozen linear without adapter saves nothing.
- Under autocast each such linear casts an fp32 input (a norm's output) to 16-bit itself, so every one
  saves its own copy; a 16-bit input (the attention output, the MLP product) is shared.
- RMSNorm saves its fp32 input copy; with a trained weight also the normalised value (residual dtype);
  its output only through the linears that save it. LayerNorm saves its input.
- SDPA/flash save q, k, v at their own (GQA) size, the output and a fp32 log-sum-exp per head;
  eager expands k/v to all heads, keeps the fp32 softmax (+ its 16-bit cast) and its output copy only
  for an o_proj that saves it. A gated MLP saves gate, act(gate), up (+ their product for a down_proj
  that saves it); a GeLU MLP its pre-activation (+ the activation).
- Backward of one layer holds, beyond its saved tensors, the incoming residual gradient and either
  the MLP's gradients or eager attention's score gradient and softmax-backward output (the saved
  16-bit cast is freed by then, and so is everything the MLP side saved); with checkpointing eager's
  causal mask (b·s², residual dtype) is a checkpoint input, live until backward ends.

Liger's kernels (``liger``: liger-kernel 0.8.5, as transformers' ``use_liger_kernel`` applies them):
``LigerRMSNormFunction`` saves its input X itself and a fp32 rstd per row (``ops/rms_norm.py``:
``save_for_backward(X, W, RSTD)``; its backward writes dX into dY, ``in_place=True``), so a norm keeps r·h + 4
per token and the layer's first norm nothing beyond the layer input; ``LigerSiLUMulFunction`` /
``LigerGELUMulFunction`` save gate and up only and write their gradients into them (``ops/swiglu.py``
``save_for_backward(a, b)``, ``swiglu_backward`` returns ``a``, ``b``), so the MLP keeps 2·f (+ the product
down_proj saves) and its backward adds only the product's gradient. Liger's RoPE saves cos and sin, as the
eager one does.

Notation: e = bytes of a compute-dtype value (2 in 16-bit, 4 in fp32); r = bytes of the residual stream
(4 in fp32 and under autocast, e in pure 16-bit).
"""

from __future__ import annotations

from memfit.estimate.constants import Profile
from memfit.spec.model import ModelSpec

# what a decoder-layer linear reads: a norm's output (attn_in, mlp_in), the attention output, the MLP product
ROLES = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "query_key_value": "attn_in",
         "o_proj": "attn_out", "dense": "attn_out",
         "gate_proj": "mlp_in", "up_proj": "mlp_in", "dense_h_to_4h": "mlp_in",
         "down_proj": "mlp_out", "dense_4h_to_h": "mlp_out", "w2": "mlp_out", "experts.down_proj": "mlp_out",
         "shared_expert.down_proj": "mlp_out", "c_attn": "attn_in", "attn.c_proj": "attn_out", "c_fc": "mlp_in",
         "mlp.c_proj": "mlp_out"}  # any other (gate/up, experts' w1/w3, routers) reads the MLP's norm output
_CACHE: dict = {}
_PER_TOKEN: dict = {}


def savers(model: ModelSpec, trained: bool, adapted: frozenset, shares: bool) -> tuple[int, int, int, int, int]:
    """Linears per role that save their input: (attn_in, attn_out, mlp_in, mlp_out, head). ``trained``: the base
    weights are trained (full fine-tuning); ``adapted``: the linears carrying a LoRA-style adapter, whose first
    product reads the linear's input (empty for every other method); ``shares``: that read is the same tensor
    (no dropout, no dtype cast)."""
    key = (id(model), trained, adapted, shares)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is model:
        return hit[1]
    counts = {"attn_in": 0, "attn_out": 0, "mlp_in": 0, "mlp_out": 0}
    for lin in model.linears:
        role = ROLES.get(lin.name, "mlp_in")
        if trained or (shares and lin.name in adapted):
            counts[role] += 1
    out = (counts["attn_in"], counts["attn_out"], counts["mlp_in"], counts["mlp_out"], int(trained))
    _CACHE[key] = (model, out)
    return out


def norm_input_bytes(model: ModelSpec, r: float, trained: bool, liger: bool = False) -> float:
    """Per token: RMSNorm's fp32 input copy (+ the normalised value when its weight is trained); Liger's its
    input itself and a fp32 rstd; LayerNorm's input (its backward recomputes the rest from mean and rstd)."""
    if model.norm == "rmsnorm":
        return model.hidden * r + 4.0 if liger else model.hidden * (4.0 + (r if trained else 0.0))
    return model.hidden * r


def mlp_saved_per_token(model: ModelSpec, e: float, liger: bool, product: bool) -> float:
    """What the MLP saves per token: gate, act(gate), up (Liger's fused gate-activation: gate and up), a GeLU
    MLP its pre-activation; + the product when down_proj saves it."""
    gated = model.mlp in ("swiglu", "geglu")
    return e * model.intermediate * (((2 if liger else 3) if gated else 1) + (1 if product else 0))


def layer_saved_per_token(model: ModelSpec, e: float, r: float, attention: str, sv: tuple, autocast: bool,
                          trained_norms: bool, e_mlp: float = 0.0, liger: bool = False) -> tuple[float, float, float]:
    """(bytes per token, of which freed before attention's backward, bytes per query-key pair and head)
    one layer saves for backward. The second figure is what the MLP side (its norm, the MLP, o_proj's
    input) saves: backward has used and freed it when it reaches the attention."""
    h, q, kv = model.hidden, model.q_dim, model.kv_dim
    attn_in, attn_out, mlp_in, mlp_out, _ = sv

    def out(count: int) -> float:  # a norm's output as the linears reading it save it
        return 0.0 if count == 0 else h * (e * count if autocast else e)

    norm_in = norm_input_bytes(model, r, trained_norms, liger)
    if model.norms_per_layer == 1:  # parallel attention: one norm feeds attention and MLP
        attn_side, mlp_side = norm_in + out(attn_in + mlp_in), 0.0
    else:
        attn_side = norm_in + out(attn_in) + (model.norms_per_layer - 2) * norm_in
        mlp_side = norm_in + out(mlp_in)
    if model.qk_norm:  # per-head RMSNorm on q and k
        attn_side += e * (q + kv) if liger else (4.0 + (r if trained_norms else 0.0)) * (q + kv)
    score = 0.0
    if attention == "eager":
        attn_side += e * 3 * q  # q and k, v expanded to all heads (repeat_kv)
        mlp_side += e * q if attn_out else 0.0  # the contiguous output copy o_proj saves
        if model.family == "falcon":  # Falcon's eager softmax runs in the compute dtype
            score = e
        else:  # fp32 softmax, cast back to the compute dtype (no cast in fp32)
            score = 4.0 + (e if e != 4.0 else 0.0)
        score += (1.0 + e) if model.attention_dropout > 0 else 0.0
    else:
        attn_side += e * (q + 2 * kv) + e * q + 4.0 * model.heads  # q, k, v, output, fp32 log-sum-exp
    mlp_side += mlp_saved_per_token(model, e_mlp or e, liger, bool(mlp_out))
    if model.experts:  # each routed copy's output, saved by its multiplication with the routing weight
        mlp_side += (e_mlp or e) * h * model.experts_per_token + 4.0 * model.experts  # + fp32 router softmax
    if model.hidden_dropout > 0:
        mlp_side += (1 + e) * 2 * h
    return attn_side + mlp_side, mlp_side, score


def score_bytes(model: ModelSpec, s: int, b: int, e: float, attention: str) -> float:
    """Bytes of one layer's saved score matrices (eager: the fp32 softmax and its cast; 0 for fused kernels)."""
    if attention != "eager":
        return 0.0
    score = e if model.family == "falcon" else 4.0 + (e if e != 4.0 else 0.0)
    score += (1.0 + e) if model.attention_dropout > 0 else 0.0
    return float(b) * model.heads * s * s * score


def backward_extra_bytes(model: ModelSpec, s: int, b: int, e: float, r: float, attention: str,
                         mlp_side: float, adapter_grad: float = 0.0, product_saved: bool = True,
                         e_mlp: float = 0.0, liger: bool = False, mlp_shards: int = 1) -> float:
    """What one layer's backward holds beyond its saved tensors, at its largest: the incoming residual
    gradient (r·h per token) + the larger of the MLP's gradients (gated: the product's gradient and
    those of act and up, less the product if it was saved and is freed now: 2·e·f, else 3·e·f; GeLU
    e·f, else 2·e·f) and eager attention's two s² tensors
    (fp32 score gradient + softmax backward's output; the 16-bit cast is freed) less the MLP side,
    already freed by then. ``adapter_grad``: bytes per token of the gradient of a cast adapter input
    (fp32 LoRA on a 16-bit base) that the MLP's backward adds. ``liger``: the fused gate-activation writes its
    gradients into gate and up, so only the product's gradient is new (e·f). ``mlp_shards``: DeepSpeed's TiledMLP
    runs the MLP's backward one sequence shard at a time (with transformers' own MLP: memfit train turns Liger's
    SwiGLU off under it, as its forward is the one tiled)."""
    tokens = float(b) * s
    width = model.intermediate
    if model.experts:  # experts run one after another, each on its top-k / E share of the tokens (the shared
        routed = model.experts_per_token * model.moe_intermediate  # expert on all): one's gradients at a time
        width = max(routed / model.experts, model.intermediate - routed)
    gated = model.mlp in ("swiglu", "geglu")
    factor = 1.0 if (liger and gated and mlp_shards == 1) else (2.0 if gated else 1.0) + (0.0 if product_saved else 1.0)
    mlp = tokens * ((e_mlp or e) * width * factor / mlp_shards + adapter_grad)
    if mlp_shards > 1:  # TiledMLP's backward fills the whole input's gradient shard by shard (x_grad = zeros_like(x))
        mlp += tokens * (e_mlp or e) * model.hidden
    eager = 0.0
    if attention == "eager":
        per = 2.0 * e if model.family == "falcon" else 8.0 - (e if e != 4.0 else 0.0)
        eager = tokens * model.heads * s * per - tokens * mlp_side
    elif attention == "fa2":
        eager = tokens * flash_backward_per_token(model, e)
    return tokens * r * model.hidden + max(mlp, eager)


def flash_backward_per_token(model: ModelSpec, e: float) -> float:
    """What the flash-attn 2 package's backward allocates per token beyond its saved tensors (flash-attn
    csrc/flash_attn/flash_api.cpp ``mha_bwd``; flash_attn_interface.py ``_flash_attn_backward``): the incoming
    output gradient, dq, dk, dv, the fp32 ``dq_accum`` and ``softmax_d``, and with grouped KV heads ``dk_expanded``
    / ``dv_expanded`` at every query head, summed into dk / dv at the end. Live after the MLP side is freed."""
    q, kv = model.q_dim, model.kv_dim
    return e * q + e * (q + 2 * kv) + 4.0 * q + 4.0 * model.heads + (2.0 * e * q if kv < q else 0.0)


def korthikanti_layer_bytes(model: ModelSpec, s: int, b: int, attention: str) -> float:
    """GPT-style count (Korthikanti et al. 2022, eq. 1): s·b·h·(34 + 5·a·s/h); fused kernels drop the s² term."""
    h = model.hidden
    base = 34.0 * s * b * h
    return base + (5.0 * model.heads * s * s * b if attention == "eager" else 0.0)


def activation_parts(model: ModelSpec, s: int, b: int, e: float, attention: str, checkpointing: bool,
                     profile: Profile, trained: bool = True, adapted: frozenset = frozenset(),
                     shares: bool = True, autocast: bool = False,
                     adapter_grad: float = 0.0, adapter_mlp_side: float = 0.0,
                     fp32_stream: bool = False, liger: bool = False,
                     mlp_shards: int = 1) -> tuple[float, float, float, float]:
    """(checkpointed layer inputs, layers' saved working sets, tail, backward transients) in bytes.

    Without checkpointing every layer's saved tensors are live at the start of backward (layer 0 of a
    frozen model saves no norm input: its input needs no gradient). With checkpointing each layer keeps
    its input (r·s·b·h) and ``checkpoint_extra_layers`` layers' working set is live during recomputation.
    The tail is the final norm (+ the head's input when the head is trained). The transients are one
    layer's backward working memory (+ eager attention's causal mask under checkpointing).
    ``adapter_grad``: bytes per token of a cast adapter input's gradient; ``adapter_mlp_side``: bytes per
    token the adapters of o_proj and the MLP save (freed before attention's backward). ``fp32_stream``:
    ``liger``: Liger's RMSNorm and gated activation (module docstring). ``mlp_shards``: DeepSpeed's TiledMLP
    (``runtime/sequence_parallel/ulysses_sp.py`` ``TiledMLP``: the forward per shard under no_grad, saving only
    the MLP's input, which the norm output already is; the backward recomputes one shard at a time with
    transformers' MLP), so one shard's intermediates and gradients. ``fp32_stream``:
    QLoRA after ``prepare_model_for_kbit_training`` (fp32 embeddings and norms): the residual stream is
    fp32 and so is every ``Linear4bit`` output (bitsandbytes/nn/modules.py:637 casts back to the input
    dtype), so the MLP's saved values and gradients are fp32; the attention kernel saves the 16-bit casts
    transformers makes of q, k, v."""
    scale = profile.activation_scale
    r = 4.0 if (e == 4.0 or autocast or fp32_stream) else e
    e_mlp = 4.0 if fp32_stream else e
    if profile.activation_korthikanti:
        return (model.layers * e * b * s * model.hidden * scale if checkpointing else 0.0,
                (profile.checkpoint_extra_layers if checkpointing else model.layers)
                * korthikanti_layer_bytes(model, s, b, attention) * scale, 0.0, 0.0)
    sv = savers(model, trained, adapted, shares)
    key = (id(model), e, r, attention, sv, autocast, trained, e_mlp, liger)
    hit = _PER_TOKEN.get(key)
    if hit is None or hit[0] is not model:  # cached: the planner asks for the same layer thousands of times
        if len(_PER_TOKEN) > 4096:
            _PER_TOKEN.clear()
        hit = _PER_TOKEN[key] = (model, layer_saved_per_token(model, e, r, attention, sv, autocast, trained, e_mlp,
                                                              liger))
    per_tok, mlp_side, score = hit[1]
    if mlp_shards > 1:  # the tiled MLP: its own saved set replaced by one shard's of transformers' MLP
        product = bool(sv[3])
        swap = mlp_saved_per_token(model, e_mlp, False, product) / mlp_shards - \
            mlp_saved_per_token(model, e_mlp, liger, product)
        per_tok, mlp_side = per_tok + swap, mlp_side + swap
    layer = b * s * per_tok + b * model.heads * float(s) * s * score
    tail = b * s * (norm_input_bytes(model, r, trained, liger) + (e * model.hidden if sv[4] else 0.0))
    # the product (or an adapter's own copy of it) is saved, and freed when the MLP's backward begins
    saved = sv[3] > 0 or any(ROLES.get(name) == "mlp_out" for name in adapted)
    extra = backward_extra_bytes(model, s, b, e, r, attention, mlp_side + adapter_mlp_side, adapter_grad,
                                 product_saved=saved, e_mlp=e_mlp, liger=liger, mlp_shards=mlp_shards)
    # the first norm's input is the layer input itself when no cast is needed (fp32 RMSNorm, LayerNorm, Liger's)
    same = b * s * model.hidden * (r if (model.norm != "rmsnorm" or liger) else (4.0 if r == 4.0 else 0.0))
    if checkpointing:
        if attention == "eager":  # the causal mask is a checkpoint input: live until backward ends
            extra += float(b) * s * s * r
        return (model.layers * r * b * s * model.hidden * scale,
                profile.checkpoint_extra_layers * (layer - same) * scale, tail * scale, extra * scale)
    # layer 0 of a frozen model saves no norm input: its input needs no gradient
    first = 0.0 if trained else b * s * norm_input_bytes(model, r, False, liger)
    return 0.0, (model.layers * layer - first) * scale, tail * scale, extra * scale
