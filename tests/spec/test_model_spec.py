"""ModelSpec: exact parameter counts from config.json, LoRA counts, and the error messages."""

import json

import pytest

from memfit.errors import ConfigError, MemfitError
from memfit.spec.model import list_presets, model_from_config, resolve_model


@pytest.mark.parametrize("name, expected", [
    ("llama-2-7b", 6_738_415_616),
    ("llama-2-13b", 13_015_864_320),
    ("llama-2-70b", 68_976_648_192),
    ("llama-3.1-8b", 8_030_261_248),
    ("mistral-7b", 7_241_732_096),
    ("qwen2.5-7b", 7_615_616_512),
])
def test_exact_parameter_counts(name, expected):
    assert resolve_model(name).parameters == expected


@pytest.mark.parametrize("cfg, expected", [
    # Qwen3-8B: q/k per-head norms, head_dim 128, untied
    ({"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
      "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 36, "vocab_size": 151936,
      "tie_word_embeddings": False}, 8_190_735_360),
    # Gemma-7B: head_dim 256 (q width 4096 > hidden 3072), tied by default
    ({"model_type": "gemma", "hidden_size": 3072, "intermediate_size": 24576, "num_attention_heads": 16,
      "num_key_value_heads": 16, "head_dim": 256, "num_hidden_layers": 28, "vocab_size": 256000}, 8_537_680_896),
    # Gemma-2-9B: four norms per layer
    ({"model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336, "num_attention_heads": 16,
      "num_key_value_heads": 8, "head_dim": 256, "num_hidden_layers": 42, "vocab_size": 256000}, 9_241_705_984),
])
def test_other_llama_style_families(cfg, expected):
    m = model_from_config(cfg)
    assert m.parameters == expected
    assert m.mlp == ("geglu" if cfg["model_type"].startswith("gemma") else "swiglu")


def test_falcon_180b_matches_published_size():
    m = resolve_model("falcon-180b")
    assert abs(m.parameters - 179.5e9) / 179.5e9 < 1e-3
    assert (m.kv_heads, m.head_dim, m.mlp, m.norm) == (8, 64, "gelu", "layernorm")


def test_presets_listed():
    names = list_presets()
    for needed in ("llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3.1-8b", "llama-3.1-70b",
                   "mistral-7b", "qwen2.5-7b", "falcon-180b"):
        assert needed in names


def test_tiny_llama_by_hand(tmp_path):
    # h=64, heads=4 (head_dim 16), kv=2 (kv_dim 32), f=128, L=2, V=100, untied, RMSNorm.
    # per layer: q 64*64=4096, k 64*32=2048, v 2048, o 4096, gate/up/down 3*64*128=24576,
    #            2 norms 128  -> 36992; 2 layers 73984; embed 6400, head 6400, final norm 64 -> 86848
    cfg = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = resolve_model(str(tmp_path))
    assert m.parameters == 86_848
    assert m.kv_dim == 32 and m.mlp == "swiglu"
    # LoRA r=4 on q,v: 2 layers * 4 * ((64+64) + (64+32)) = 1792
    assert m.lora_parameters(("q_proj", "v_proj"), 4) == 1792
    # all-linear r=1: sum(in+out) = 128+96+96+128+192+192+192 = 1024 per layer -> 2048
    assert m.lora_parameters("all-linear", 1) == 2048
    # tied + qwen2 biases on q/k/v: +64+32+32 per layer = +256; tied drops head 6400
    m2 = model_from_config({**cfg, "model_type": "qwen2", "tie_word_embeddings": True})
    assert m2.parameters == 86_848 + 256 - 6400
    assert m2.biases == ("q_proj", "k_proj", "v_proj")


def test_tiny_gpt_neox_by_hand():
    # h=32, heads 4, f=128, L=1, V=50: qkv 32*96+96=3168, dense 1024+32=1056, h->4h 4096+128=4224,
    # 4h->h 4096+32=4128, 2 LayerNorms 2*64=128 -> 12704; embed_in 1600, embed_out 1600, final LN 64.
    m = model_from_config({"model_type": "gpt_neox", "hidden_size": 32, "num_attention_heads": 4,
                           "intermediate_size": 128, "num_hidden_layers": 1, "vocab_size": 50})
    assert m.parameters == 12704 + 1600 + 1600 + 64
    assert m.norm == "layernorm" and m.mlp == "gelu"


def test_falcon_7b_multi_query():
    m = resolve_model("falcon-7b")
    assert m.kv_heads == 1 and m.norms_per_layer == 1
    assert m.linears[0].out_features == (71 + 2) * 64


def test_unknown_preset_lists_presets():
    with pytest.raises(MemfitError, match="llama-2-7b"):
        resolve_model("llama-9-000b")


def test_malformed_json_names_line(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('{"model_type": "llama",\n "hidden_size": }')
    with pytest.raises(ConfigError, match=r"malformed JSON at line 2"):
        resolve_model(str(p))


def test_unsupported_type_lists_types(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "t5", "d_model": 512}))
    with pytest.raises(ConfigError, match="model_type 't5' is not supported; supported: llama"):
        resolve_model(str(p))


def test_missing_field_named(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ConfigError, match="num_attention_heads"):
        resolve_model(str(p))


def test_folder_without_config(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        resolve_model(str(tmp_path))


def test_no_torch_import():
    import subprocess
    import sys
    code = ("import sys, memfit.spec.model, memfit.spec.hardware, memfit.estimate; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
