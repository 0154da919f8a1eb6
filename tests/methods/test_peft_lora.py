"""LoRA's common PEFT options in the lora method: rsLoRA, modules_to_save (trainable embeddings / head),
target_modules all-linear, per-module rank_pattern / alpha_pattern; in the estimate, the planner and training."""

import json

import pytest

from memfit.estimate import estimate
from memfit.methods import METHODS
from memfit.plan.search import plan
from memfit.spec.hardware import parse_hardware
from memfit.spec.model import resolve_model
from memfit.spec.run import run_from_dict
from memfit.spec.strategy import Strategy

OPTIONS = {"targets": "all-linear", "rank_pattern": {"q_proj": 8, "down_proj": 2}, "alpha_pattern": {"q_proj": 16},
           "modules_to_save": ["lm_head"], "rslora": True, "r": 4, "alpha": 8, "dropout": 0.0}


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    pytest.importorskip("peft")
    from conftest import dialogue_micro

    root = tmp_path_factory.mktemp("lora-options")
    return (*dialogue_micro(root), root)


def test_run_file_options_reach_the_strategy_and_peft():
    run = run_from_dict({"model": "llama-3.2-3b", "lora": OPTIONS})
    st = run.strategy
    assert st.lora_targets == ("all-linear",) and st.lora_rslora and st.lora_modules_to_save == ("lm_head",)
    assert dict(st.lora_rank_pattern) == {"q_proj": 8, "down_proj": 2}
    pytest.importorskip("peft")
    cfg = METHODS["lora"].peft_config(st, ["q_proj", "v_proj", "down_proj"])
    assert cfg.use_rslora and cfg.modules_to_save == ["lm_head"] and cfg.target_modules == "all-linear"
    assert cfg.rank_pattern == {"q_proj": 8, "down_proj": 2} and cfg.alpha_pattern == {"q_proj": 16}


def test_bad_pattern_is_one_line():
    from memfit.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        run_from_dict({"model": "llama-3.2-3b", "lora": {"rank_pattern": {"q_proj": "big"}}})
    msg = str(err.value)
    assert "\n" not in msg and "lora_rank_pattern" in msg and "positive integer" in msg and "q_proj: 32" in msg


def test_estimate_counts_patterns_and_saved_modules_like_peft(micro):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from memfit.methods.lora import model_linear_names

    model_dir = micro[0]
    st = run_from_dict({"model": str(model_dir), "lora": OPTIONS}).strategy
    est = estimate(resolve_model(str(model_dir)), parse_hardware("1xA100-80GB"), st)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir))
    peft_model = get_peft_model(base, METHODS["lora"].peft_config(st, model_linear_names(base)))
    assert est.trainable_parameters == peft_model.get_nb_trainable_parameters()[0]


def test_options_change_the_estimate_as_peft_does():
    model, hw = resolve_model("llama-3.2-3b"), parse_hardware("1xL40S-48GB")
    plain = estimate(model, hw, Strategy(lora_r=16))
    assert estimate(model, hw, Strategy(lora_r=16, lora_rslora=True)).gpu == plain.gpu  # a scale, no bytes
    wider = estimate(model, hw, Strategy(lora_r=16, lora_rank_pattern={"q_proj": 64}))
    extra = 28 * (64 - 16) * (3072 + 3072)  # q_proj at rank 64 instead of 16, 28 layers
    assert wider.trainable_parameters - plain.trainable_parameters == extra
    head = estimate(model, hw, Strategy(lora_r=16, lora_modules_to_save=("lm_head",)))
    assert head.trainable_parameters - plain.trainable_parameters == 128256 * 3072  # PEFT's trainable copy


def test_planner_keeps_the_options():
    fixed = {"lora_rank_pattern": (("q_proj", 64),), "lora_rslora": True, "lora_modules_to_save": ("lm_head",)}
    p = plan(resolve_model("llama-3.2-3b"), parse_hardware("1xL40S-48GB"), methods=["lora"], seq_len=512,
             micro_batch_size=1, fixed=fixed, explain=False)
    best = p.recommended.strategy
    assert (best.method == "lora" and best.lora_rank_pattern == (("q_proj", 64),)
            and best.lora_modules_to_save == ("lm_head",))


def test_train_with_the_options_saves_an_adapter_peft_loads(micro):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from memfit.train.api import train

    model, data, root = micro
    out = root / "out"
    run = run_from_dict({"model": str(model), "data": {"path": str(data), "format": "text", "eval_fraction": 0.0},
                         "lora": OPTIONS, "strategy": {"precision": "fp32", "seq_len": 48, "micro_batch_size": 4},
                         "training": {"max_steps": 4, "learning_rate": 2e-2, "seed": 0}, "output_dir": str(out)})
    result = train(run)
    assert result.final_loss is not None
    saved = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert saved["use_rslora"] and saved["rank_pattern"] == {"q_proj": 8, "down_proj": 2}
    assert saved["modules_to_save"] == ["lm_head"]
    ids = torch.arange(20).unsqueeze(0)
    base = AutoModelForCausalLM.from_pretrained(str(model))
    with torch.no_grad():
        plain = base(ids).logits
        adapted = PeftModel.from_pretrained(base, str(out / "adapter"))(ids).logits
    assert not torch.allclose(plain, adapted)


def test_cli_flags_reach_estimate_and_plan():
    import subprocess
    import sys

    env = {"PYTHONPATH": ".", "MEMFIT_HWCAL": "off", "PATH": "/usr/bin:/bin"}
    args = ["--model", "llama-3.2-3b", "--gpus", "1xL40S-48GB", "--lora-rank-pattern", "q_proj=64",
            "--lora-modules-to-save", "lm_head", "--lora-rslora", "--json"]
    out = json.loads(subprocess.run([sys.executable, "-m", "memfit", "estimate", *args], capture_output=True,
                                    text=True, env=env, check=True).stdout)
    st = out["strategy"]
    assert st["lora_rank_pattern"] == {"q_proj": 64} and st["lora_modules_to_save"] == ["lm_head"] and st["lora_rslora"]
    res = subprocess.run([sys.executable, "-m", "memfit", "plan", "--model", "llama-3.2-3b", "--gpus", "1xL40S-48GB",
                          "--lora-rank-pattern", "q_proj=big", "--seq-len", "512"], capture_output=True, text=True,
                         env=env)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "q_proj=64,down_proj=8" in res.stderr
