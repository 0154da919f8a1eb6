"""The method registry: one object per method, read by spec, estimate, plan, train and trace; DoRA added
through it alone (memfit/methods/dora/ + one registry line)."""

import pytest

from memfit.errors import ConfigError
from memfit.estimate import estimate
from memfit.methods import METHODS, PLANNED
from memfit.methods.base import matched_linears, peft_target_modules
from memfit.plan.search import plan
from memfit.spec.hardware import parse_hardware
from memfit.spec.model import resolve_model
from memfit.spec.strategy import Strategy
from memfit.plan.space import make_strategy


def test_registry_lists_every_method_once():
    assert list(METHODS) == ["full", "lora", "qlora", "meft", "dora", "peft"]
    assert {m.family for m in METHODS.values()} == {"full", "lora", "qlora", "meft"}
    assert "dora" not in PLANNED and set(PLANNED) == {"full", "lora", "qlora", "meft"}
    assert Strategy(method="dora").trains_adapter and not Strategy(method="full").trains_adapter
    with pytest.raises(ConfigError, match=r"method \(--method\): got 'bogus'; should be 'full', 'lora', "
                                          r"'qlora', 'meft', 'dora' or 'peft'"):
        make_strategy(method="bogus")


def test_one_lora_target_matcher():
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert matched_linears(names, ("all-linear",)) == names
    assert matched_linears(names, "all-linear") == names
    assert matched_linears(names, ("model.layers.0.self_attn.v_proj", "q_proj", "nope")) == ["q_proj", "v_proj"]
    assert peft_target_modules(names, ("v_proj", "q_proj")) == ["v_proj", "q_proj"]  # the run's order
    assert peft_target_modules(names, ("q_proj", "all-linear")) == "all-linear"
    assert peft_target_modules(names, ("nope",)) == []
    llama = resolve_model("llama-2-7b")
    assert [lin.name for lin in llama.lora_linears(("all-linear",))] == llama.linear_names()


def test_dora_estimate_adds_magnitudes_and_two_saved_products_per_adapted_linear():
    """llama-2-7b, q_proj + v_proj (4096 outputs each), 32 layers, fp32, no dropout, no checkpointing:
    DoRA adds 32 x 8192 magnitudes, and per token and adapted linear it keeps the base output and
    B(A(x)) (4 bytes each): 32 layers x 512 tokens x 8192 outputs x 8 bytes = 1 GiB."""
    model, hw = resolve_model("llama-2-7b"), parse_hardware("1xA100-80GB")
    keys = dict(precision="fp32", lora_targets=("q_proj", "v_proj"), lora_dropout=0.0, seq_len=512)
    lora = estimate(model, hw, Strategy(method="lora", **keys)).to_dict()
    dora = estimate(model, hw, Strategy(method="dora", **keys)).to_dict()
    assert dora["model"]["trainable_parameters"] - lora["model"]["trainable_parameters"] == 32 * 8192
    mem_l, mem_d = lora["memory"]["gpu_bytes"], dora["memory"]["gpu_bytes"]
    assert mem_d["lora_intermediates"] - mem_l["lora_intermediates"] == 32 * 512 * 8192 * 8
    # the magnitudes are trained like the adapters: fp32 weight, gradient and two Adam moments
    assert mem_d["weights"] - mem_l["weights"] == 32 * 8192 * 4
    assert mem_d["optimizer"] - mem_l["optimizer"] == 32 * 8192 * 8


def test_dora_with_dropout_keeps_the_cast_weight_copy():
    """bf16-mixed with fp32 adapters and lora_dropout > 0: PEFT recomputes the base output from the
    dropped fp32 input, and autocast's 16-bit copy of W.to(fp32) is saved per adapted linear."""
    model, hw = resolve_model("llama-2-7b"), parse_hardware("1xA100-80GB")
    keys = dict(precision="bf16-mixed", lora_targets=("q_proj", "v_proj"), seq_len=512)
    d0 = estimate(model, hw, Strategy(method="dora", lora_dropout=0.0, **keys)).to_dict()["memory"]["gpu_bytes"]
    l1 = estimate(model, hw, Strategy(method="lora", lora_dropout=0.1, **keys)).to_dict()["memory"]["gpu_bytes"]
    d1 = estimate(model, hw, Strategy(method="dora", lora_dropout=0.1, **keys)).to_dict()["memory"]["gpu_bytes"]
    weights = 32 * 2 * 4096 * 4096 * 2  # 32 layers x 2 linears x 4096² x 2 bytes
    products = 32 * 512 * 8192 * (2 + 2)  # base output and B(A(x)), both 16-bit under autocast
    assert d1["lora_intermediates"] - l1["lora_intermediates"] == weights + products
    assert d1["lora_intermediates"] > d0["lora_intermediates"]


def test_planner_searches_dora_only_when_asked():
    model, hw = resolve_model("llama-2-7b"), parse_hardware("1xA100-80GB")
    default = plan(model, hw, seq_len=512, micro_batch_size=1)
    assert all(c.strategy.method != "dora" for c in default.candidates)
    asked = plan(model, hw, seq_len=512, micro_batch_size=1, methods=["dora"])
    assert asked.recommended is not None and asked.recommended.strategy.method == "dora"


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    pytest.importorskip("peft")
    from conftest import dialogue_micro

    root = tmp_path_factory.mktemp("methods")
    return (*dialogue_micro(root), root)


def test_dora_trains_saves_and_reloads(micro):
    """DoRA through the registry: peft's use_dora wrapping, magnitudes trained and saved, the saved
    adapter reloads (METHODS['dora'].load) to the trained model's logits."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from memfit.spec.run import run_from_dict
    from memfit.train.api import train

    model, data, root = micro
    run = run_from_dict({"model": str(model), "data": {"path": str(data), "format": "text", "eval_fraction": 0.0},
                         "strategy": {"method": "dora", "precision": "fp32", "seq_len": 48, "micro_batch_size": 4,
                                      "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
                                      "lora_targets": ["all-linear"]},
                         "training": {"max_steps": 8, "learning_rate": 2e-2, "seed": 0},
                         "output_dir": str(root / "out")})
    result = train(run)
    assert result.final_loss < result.first_loss
    saved = load_file(str(next((root / "out" / "adapter").glob("*.safetensors"))))
    magnitudes = [k for k in saved if "lora_magnitude_vector" in k]
    assert len(magnitudes) == 2 * 7  # every linear of both layers (all-linear), one vector each
    assert result.model["lora_targets"] == ["all-linear"]
    ids = torch.arange(20).unsqueeze(0)
    base = AutoModelForCausalLM.from_pretrained(str(model))
    with torch.no_grad():
        plain = base(ids).logits
        reloaded = METHODS["dora"].load(base, root / "out" / "adapter")
        adapted = reloaded(ids).logits
    assert not torch.allclose(plain, adapted)  # the trained adapter (magnitudes and B) changes the output


def test_trace_matches_all_linear_like_the_trainer(micro):
    """The trace builds the trainer's own LoraConfig: 'all-linear' is traced (its old copy refused it)."""
    pytest.importorskip("transformers")
    from memfit.measure.trace import traced_step

    model, _, _ = micro
    keys = dict(precision="fp32", seq_len=32, lora_r=4, lora_dropout=0.0)
    some = traced_step(str(model), Strategy(method="lora", lora_targets=("q_proj",), **keys))
    every = traced_step(str(model), Strategy(method="lora", lora_targets=("all-linear",), **keys))
    dora = traced_step(str(model), Strategy(method="dora", lora_targets=("all-linear",), **keys))
    assert every["model_states_bytes"] > some["model_states_bytes"]
    assert dora["peak_bytes"] > every["peak_bytes"]


def test_which_methods_fsdp1_wraps_as_adapter_units():
    """memfit's FSDP1 engine installs PEFT's fsdp_auto_wrap_policy, and the estimator gathers one decoder layer in
    backward, exactly for the LoRA-style methods (Method.fsdp_adapter_units)."""
    from memfit.methods import METHODS

    assert {n for n, m in METHODS.items() if m.fsdp_adapter_units} == {"lora", "qlora", "dora"}
