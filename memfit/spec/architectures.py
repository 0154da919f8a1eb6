"""The config.json readers, one per block structure: each turns a parsed Hugging Face config into a
:class:`~memfit.spec.model.ModelSpec` (see memfit.spec.model's docstring for the supported model types)."""

from __future__ import annotations

from memfit.errors import ConfigError
from memfit.spec.model import (FALCON_TYPES, LLAMA_STYLE, MOE_TYPES, SUPPORTED_TYPES, Linear,
                               ModelSpec)


def _need(cfg: dict, key: str, where: str, *alts: str) -> int:
    for k in (key, *alts):
        value = cfg.get(k)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{where}: '{k}' must be a positive integer, got {value!r}")
            return value
    names = " or ".join(repr(k) for k in (key, *alts))
    raise ConfigError(f"{where}: missing {names}; a decoder config.json from Hugging Face has it")


def _llama_style(cfg: dict, name: str, where: str) -> ModelSpec:
    mt = cfg["model_type"]
    h = _need(cfg, "hidden_size", where)
    heads = _need(cfg, "num_attention_heads", where)
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or h // heads
    f = _need(cfg, "intermediate_size", where)
    attn_bias = bool(cfg.get("attention_bias", False)) or mt == "qwen2"
    mlp_bias = bool(cfg.get("mlp_bias", False))
    o_bias = bool(cfg.get("attention_bias", False))
    tie_default = mt in ("gemma", "gemma2")
    linears = (
        Linear("q_proj", h, heads * head_dim, attn_bias),
        Linear("k_proj", h, kv * head_dim, attn_bias),
        Linear("v_proj", h, kv * head_dim, attn_bias),
        Linear("o_proj", heads * head_dim, h, o_bias),
        Linear("gate_proj", h, f, mlp_bias),
        Linear("up_proj", h, f, mlp_bias),
        Linear("down_proj", f, h, mlp_bias),
    )
    return ModelSpec(
        name=name, family=mt, hidden=h, layers=_need(cfg, "num_hidden_layers", where), heads=heads,
        kv_heads=kv, head_dim=head_dim, intermediate=f, vocab=_need(cfg, "vocab_size", where),
        mlp="geglu" if mt in ("gemma", "gemma2") else "swiglu", norm="rmsnorm",
        tie_embeddings=bool(cfg.get("tie_word_embeddings", tie_default)),
        biases=tuple(lin.name for lin in linears if lin.bias),
        max_positions=int(cfg.get("max_position_embeddings") or 2048), linears=linears,
        norms_per_layer=4 if mt == "gemma2" else 2, qk_norm=mt == "qwen3",
        attention_dropout=float(cfg.get("attention_dropout") or 0.0), source=where,
    )


def _moe(cfg: dict, name: str, where: str) -> ModelSpec:
    """Mixtral (block_sparse_moe: router ``gate``, experts w1/w3 (in) and w2 (out)) and Qwen2-MoE (router
    ``gate``, experts gate/up/down_proj of moe_intermediate_size, a shared expert of
    shared_expert_intermediate_size and its 1-wide ``shared_expert_gate``): PEFT's names at transformers 4.x."""
    dense = _llama_style({**cfg, "model_type": "llama", "intermediate_size": 1}, name, where)
    h = dense.hidden
    e = _need(cfg, "num_local_experts", where, "num_experts")
    k = _need(cfg, "num_experts_per_tok", where)
    attn = dense.linears[:4]
    if cfg["model_type"] == "mixtral":
        f = _need(cfg, "intermediate_size", where)
        mlp = (Linear("gate", h, e), Linear("w1", h, f, count=e, active=k / e),
               Linear("w3", h, f, count=e, active=k / e), Linear("w2", f, h, count=e, active=k / e))
        width = k * f
    else:
        f = _need(cfg, "moe_intermediate_size", where)
        fs = int(cfg.get("shared_expert_intermediate_size") or 0)
        mlp = (Linear("gate", h, e), Linear("experts.gate_proj", h, f, count=e, active=k / e),
               Linear("experts.up_proj", h, f, count=e, active=k / e),
               Linear("experts.down_proj", f, h, count=e, active=k / e))
        if fs:
            mlp += (Linear("shared_expert.gate_proj", h, fs), Linear("shared_expert.up_proj", h, fs),
                    Linear("shared_expert.down_proj", fs, h), Linear("shared_expert_gate", h, 1))
        width = k * f + fs
    attn_bias = cfg["model_type"] == "qwen2_moe" or bool(cfg.get("attention_bias", False))
    if attn_bias:
        attn = tuple(Linear(lin.name, lin.in_features, lin.out_features, lin.name != "o_proj") for lin in attn)
    linears = attn + mlp
    return ModelSpec(
        name=name, family=cfg["model_type"], hidden=h, layers=dense.layers, heads=dense.heads,
        kv_heads=dense.kv_heads, head_dim=dense.head_dim, intermediate=width, vocab=dense.vocab, mlp="swiglu",
        norm="rmsnorm", tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        biases=tuple(lin.name for lin in linears if lin.bias), max_positions=dense.max_positions,
        linears=linears, attention_dropout=dense.attention_dropout, experts=e, experts_per_token=k,
        moe_intermediate=f, source=where,
    )


def _gpt_bigcode(cfg: dict, name: str, where: str) -> ModelSpec:
    """GPT-BigCode (SantaCoder, StarCoder): c_attn (q + one shared k, v head under multi_query), c_proj,
    c_fc, c_proj, all with biases; LayerNorm; learned positions (wpe); head tied to wte."""
    h = _need(cfg, "n_embd", where, "hidden_size")
    heads = _need(cfg, "n_head", where, "num_attention_heads")
    kv = 1 if cfg.get("multi_query", True) else heads
    f = cfg.get("n_inner") or 4 * h
    head_dim = h // heads
    positions = _need(cfg, "n_positions", where, "max_position_embeddings")
    linears = (Linear("c_attn", h, h + 2 * kv * head_dim, True), Linear("attn.c_proj", h, h, True),
               Linear("c_fc", h, f, True), Linear("mlp.c_proj", f, h, True))
    return ModelSpec(
        name=name, family="gpt_bigcode", hidden=h, layers=_need(cfg, "n_layer", where, "num_hidden_layers"),
        heads=heads, kv_heads=kv, head_dim=head_dim, intermediate=f, vocab=_need(cfg, "vocab_size", where),
        mlp="gelu", norm="layernorm", tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        biases=tuple(lin.name for lin in linears), max_positions=positions, linears=linears,
        attention_dropout=float(cfg.get("attn_pdrop") or 0.0), hidden_dropout=float(cfg.get("resid_pdrop") or 0.0),
        position_embeddings=positions * h, source=where,
    )


def _falcon(cfg: dict, name: str, where: str) -> ModelSpec:
    h = _need(cfg, "hidden_size", where, "n_embed")
    heads = _need(cfg, "num_attention_heads", where, "n_head")
    head_dim = h // heads
    new_arch = bool(cfg.get("new_decoder_architecture", False))
    if new_arch:
        kv = cfg.get("num_kv_heads") or heads
    else:
        kv = 1 if cfg.get("multi_query", True) else heads
    f = cfg.get("ffn_hidden_size") or 4 * h
    bias = bool(cfg.get("bias", False))
    parallel = bool(cfg.get("parallel_attn", True))
    if new_arch:
        norms = cfg.get("num_ln_in_parallel_attn") or 2
    else:
        norms = 1 if parallel else 2
    linears = (
        Linear("query_key_value", h, (heads + 2 * kv) * head_dim, bias),
        Linear("dense", h, h, bias),
        Linear("dense_h_to_4h", h, f, bias),
        Linear("dense_4h_to_h", f, h, bias),
    )
    return ModelSpec(
        name=name, family="falcon", hidden=h, layers=_need(cfg, "num_hidden_layers", where, "n_layer"),
        heads=heads, kv_heads=kv, head_dim=head_dim, intermediate=f, vocab=_need(cfg, "vocab_size", where),
        mlp="gelu", norm="layernorm", tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        biases=tuple(lin.name for lin in linears if lin.bias),
        max_positions=int(cfg.get("max_position_embeddings") or 2048), linears=linears,
        norms_per_layer=int(norms), parallel_attn=parallel,
        attention_dropout=float(cfg.get("attention_dropout") or 0.0),
        hidden_dropout=float(cfg.get("hidden_dropout") or 0.0), source=where,
    )


def _gpt_neox(cfg: dict, name: str, where: str) -> ModelSpec:
    h = _need(cfg, "hidden_size", where)
    heads = _need(cfg, "num_attention_heads", where)
    f = cfg.get("intermediate_size") or 4 * h
    bias = bool(cfg.get("attention_bias", True))
    linears = (
        Linear("query_key_value", h, 3 * h, bias),
        Linear("dense", h, h, bias),
        Linear("dense_h_to_4h", h, f, True),
        Linear("dense_4h_to_h", f, h, True),
    )
    return ModelSpec(
        name=name, family="gpt_neox", hidden=h, layers=_need(cfg, "num_hidden_layers", where), heads=heads,
        kv_heads=heads, head_dim=h // heads, intermediate=f, vocab=_need(cfg, "vocab_size", where),
        mlp="gelu", norm="layernorm", tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        biases=tuple(lin.name for lin in linears if lin.bias),
        max_positions=int(cfg.get("max_position_embeddings") or 2048), linears=linears, norms_per_layer=2,
        parallel_attn=bool(cfg.get("use_parallel_residual", True)),
        attention_dropout=float(cfg.get("attention_dropout") or 0.0),
        hidden_dropout=float(cfg.get("hidden_dropout") or 0.0), source=where,
    )


def spec_from_config(cfg: dict, name: str, where: str) -> ModelSpec:
    mt = cfg.get("model_type")
    if mt in LLAMA_STYLE:
        return _llama_style(cfg, name, where)
    if mt in FALCON_TYPES:
        return _falcon(cfg, name, where)
    if mt == "gpt_neox":
        return _gpt_neox(cfg, name, where)
    if mt in MOE_TYPES:
        return _moe(cfg, name, where)
    if mt == "gpt_bigcode":
        return _gpt_bigcode(cfg, name, where)
    raise ConfigError(
        f"{where}: model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_TYPES)} "
        "(decoder configs with those block structures)"
    )


