"""method=peft: any PEFT method from its own config, counted by PEFT on a meta-device copy of the model,
priced per wrapped layer type, trained through memfit's train path and saved as a PEFT adapter."""

import json
import subprocess
import sys

import pytest

from memfit.errors import ConfigError
from memfit.estimate import estimate
from memfit.spec.hardware import parse_hardware
from memfit.spec.model import resolve_model
from memfit.spec.run import run_from_dict
from memfit.spec.strategy import Strategy

IA3 = {"peft_type": "IA3", "target_modules": ["k_proj", "v_proj", "down_proj"], "feedforward_modules": ["down_proj"]}
VERA = {"peft_type": "VERA", "r": 8, "target_modules": ["q_proj", "v_proj"]}
LOHA = {"peft_type": "LOHA", "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
CONFIGS = {"ia3": IA3, "vera": VERA, "loha": LOHA}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    from memfit.methods.peft import count

    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "cache"))  # counts cached in a fresh folder per test
    monkeypatch.setattr(count, "_MEMO", {})
    monkeypatch.setattr(count, "_UNSAVED", {})


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    pytest.importorskip("peft")
    from conftest import dialogue_micro

    root = tmp_path_factory.mktemp("peft")
    return (*dialogue_micro(root), root)


def _peft_trainable(model_dir, config: dict) -> int:
    """PEFT's own count on the real (CPU) tiny model."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from memfit.methods.peft.count import peft_config_object

    base = AutoModelForCausalLM.from_pretrained(str(model_dir))
    return get_peft_model(base, peft_config_object(config)).get_nb_trainable_parameters()[0]


@pytest.mark.parametrize("name", sorted(CONFIGS) + ["prompt_tuning", "fourierft", "adalora", "boft", "shira"])
def test_trainable_count_is_peft_own(micro, name):
    model_dir = micro[0]
    extra = {"prompt_tuning": {"peft_type": "PROMPT_TUNING", "num_virtual_tokens": 5},
             "fourierft": {"peft_type": "FOURIERFT", "n_frequency": 20, "target_modules": ["q_proj"]},
             "adalora": {"peft_type": "ADALORA", "init_r": 6, "target_r": 4, "total_step": 10,
                         "target_modules": ["q_proj", "v_proj"]},
             # built on the CPU with 1 and 2 layers and extrapolated (the meta device cannot run their init)
             "boft": {"peft_type": "BOFT", "boft_block_size": 4, "target_modules": ["q_proj", "v_proj"]},
             "shira": {"peft_type": "SHIRA", "r": 2, "target_modules": ["q_proj"]}}
    config = CONFIGS.get(name) or extra[name]
    st = Strategy(method="peft", peft_config=config, precision="fp32")
    est = estimate(resolve_model(str(model_dir)), parse_hardware("1xA100-80GB"), st)
    assert est.trainable_parameters == _peft_trainable(model_dir, config)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_train_saves_an_adapter_peft_loads(micro, name):
    """`memfit train` with a peft_config block: the run trains, saves a PEFT adapter, and
    PeftModel.from_pretrained loads it onto the base, changing its output."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from memfit.train.api import train

    model, data, root = micro
    out = root / f"out-{name}"
    run = run_from_dict({"model": str(model), "data": {"path": str(data), "format": "text", "eval_fraction": 0.0},
                         "peft_config": CONFIGS[name],
                         "strategy": {"precision": "fp32", "seq_len": 48, "micro_batch_size": 4},
                         "training": {"max_steps": 4, "learning_rate": 5e-2, "seed": 0}, "output_dir": str(out)})
    assert run.strategy.method == "peft"
    result = train(run)
    assert result.final_loss is not None and result.model["trainable"] == _peft_trainable(model, CONFIGS[name])
    assert result.predicted is not None  # the estimate of this run (method=peft) rode along
    folder = out / "adapter"
    assert json.loads((folder / "adapter_config.json").read_text())["peft_type"] == CONFIGS[name]["peft_type"]
    ids = torch.arange(20).unsqueeze(0)
    base = AutoModelForCausalLM.from_pretrained(str(model))
    with torch.no_grad():
        plain = base(ids).logits
        adapted = PeftModel.from_pretrained(base, str(folder))(ids).logits
    assert not torch.allclose(plain, adapted)


def test_loha_adapter_memory_by_hand():
    """LoHa on Llama-3.2-3B's q_proj (3072 -> 3072) and v_proj (3072 -> 1024), pure bf16, 4 x 768 tokens, 28
    layers, no checkpointing: each wrapped linear keeps its fp32 cast input (4 B x 3072 per token) and its fp32
    delta weight (4 B x in x out) per layer (peft/tuners/loha/layer.py:266-272)."""
    pytest.importorskip("peft")
    st = Strategy(method="peft", peft_config={**LOHA, "r": 32, "alpha": 64}, precision="bf16", micro_batch_size=4,
                  seq_len=768)
    est = estimate(resolve_model("llama-3.2-3b"), parse_hardware("1xL40S-48GB"), st)
    per_token = 4 * 3072 + 4 * 3072
    per_layer = 4 * 3072 * 3072 + 4 * 3072 * 1024
    assert est.gpu["lora_intermediates"] == 28 * (4 * 768 * per_token + per_layer)
    # trained: r x (in + out) x 2 (two Hadamard factors) per linear, over 28 layers; PEFT's own count
    assert est.trainable_parameters == 28 * 2 * 32 * ((3072 + 3072) + (3072 + 1024))


def test_ia3_and_vera_rules_by_hand():
    """IA3 keeps the base output of k/v (bf16, out values) and the fp32 input of the feed-forward down_proj;
    VeRA keeps the rank-r product and the B output in fp32 (peft/tuners/ia3/layer.py:188-197, vera 284-285)."""
    pytest.importorskip("peft")
    model, hw = resolve_model("llama-3.2-3b"), parse_hardware("1xL40S-48GB")
    tokens = 4 * 768
    ia3 = estimate(model, hw, Strategy(method="peft", peft_config=IA3, precision="bf16", micro_batch_size=4,
                                       seq_len=768))
    assert ia3.gpu["lora_intermediates"] == 28 * tokens * (2 * 1024 + 2 * 1024 + 4 * 8192)
    vera = estimate(model, hw, Strategy(method="peft", peft_config={**VERA, "r": 256}, precision="bf16",
                                        micro_batch_size=4, seq_len=768))
    assert vera.gpu["lora_intermediates"] == 28 * tokens * 4 * ((256 + 3072) + (256 + 1024))


@pytest.mark.parametrize("raw, words", [
    ({"peft_type": "NOPE"}, ["strategy.peft_config", "peft_type 'NOPE' is not a PEFT method", "IA3", "set "]),
    ({"target_modules": ["q_proj"]}, ["strategy.peft_config", "peft_type None", "allowed:"]),
    ({"peft_type": "LORA", "r": 8}, ["strategy.peft_config", "use method=lora"]),
])
def test_bad_peft_config_is_one_line(raw, words):
    with pytest.raises(ConfigError) as err:
        run_from_dict({"model": "llama-3.2-3b", "peft_config": raw})
    msg = str(err.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_a_field_peft_refuses_is_one_line():
    pytest.importorskip("peft")
    st = Strategy(method="peft", peft_config={**IA3, "bogus": 1})
    with pytest.raises(ConfigError) as err:
        estimate(resolve_model("llama-3.2-3b"), parse_hardware("1xL40S-48GB"), st)
    msg = str(err.value)
    assert "\n" not in msg and "peft_config.bogus" in msg and "IA3Config" in msg and "remove it" in msg


def test_method_and_config_go_together():
    with pytest.raises(ValueError, match="method=peft reads a peft_config"):
        Strategy(method="peft")
    with pytest.raises(ValueError, match="method=peft reads a peft_config"):
        Strategy(method="lora", peft_config=IA3)


def test_adapter_config_json_path_and_round_trip(tmp_path):
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({**VERA, "base_model_name_or_path": "x", "inference_mode": True}))
    run = run_from_dict({"model": "llama-3.2-3b", "peft_config": str(tmp_path)})
    assert json.loads(run.strategy.peft_config) == {**VERA, "task_type": "CAUSAL_LM"}
    import yaml

    from memfit.spec.run import dump_run

    assert run_from_dict(yaml.safe_load(dump_run(run))) == run


def test_the_named_methods_plan_without_torch_and_peft_counts_once(tmp_path):
    """The plain planner imports no torch; a peft estimate counts once, then reads its cache (torch blocked)."""
    env = {"PYTHONPATH": ".", "MEMFIT_HWCAL": "off", "MEMFIT_CACHE": str(tmp_path / "cache")}
    code = ("import sys; from memfit.plan.search import plan; from memfit.spec.model import resolve_model; "
            "from memfit.spec.hardware import parse_hardware; "
            "plan(resolve_model('llama-3.2-3b'), parse_hardware('1xRTX4090-24GB'), seq_len=512, micro_batch_size=1); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    pytest.importorskip("peft")
    from memfit.methods.peft import count

    st = Strategy(method="peft", peft_config=IA3)
    first = estimate(resolve_model("llama-3.2-3b"), parse_hardware("1xL40S-48GB"), st).trainable_parameters
    assert not (tmp_path / "cache" / "peft-counts").exists()  # pricing writes no file
    assert count.save_counts() == 1 and count.save_counts() == 0  # the CLI saves what the command counted
    assert len(list((tmp_path / "cache" / "peft-counts").glob("*.json"))) == 1
    code = ("import sys; sys.modules['torch'] = None; from memfit.estimate import estimate; "
            "from memfit.spec.model import resolve_model; from memfit.spec.hardware import parse_hardware; "
            "from memfit.spec.strategy import Strategy; import json; "
            f"st = Strategy(method='peft', peft_config=json.loads({json.dumps(json.dumps(IA3))})); "
            "print(estimate(resolve_model('llama-3.2-3b'), parse_hardware('1xL40S-48GB'), st).trainable_parameters)")
    out = subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True, text=True).stdout
    assert float(out.split()[-1]) == first


def _bench():
    from bench import gpu_published

    return gpu_published


def test_published_peft_rows_are_expressed(tmp_path, capsys):
    """bench/gpu_published.py predicts a PEFT row from its peft_config (here IA3 on Mistral-7B)."""
    pytest.importorskip("peft")
    G = _bench()
    row = {"id": "ia3", "source_group": "g", "gpu": {"model": "NVIDIA A100 80GB", "count": 1}, "engine": "single GPU",
           "model": "mistralai/Mistral-7B-v0.1", "method": "ia3", "peft_config": IA3, "precision": "pure bf16",
           "gradient_checkpointing": "no", "sequence_length": {"value": 512}, "micro_batch_size": 2,
           "status": "success",
           "primary_memory": {"value": 20.0, "unit": "GB", "metric_class": "torch_max_memory_reserved"}}
    path = tmp_path / "runs.jsonl"
    path.write_text(json.dumps(row) + "\n")
    assert G.main(["--file", str(path), "--json", "--no-logo"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["skipped"] == [] and out["rows"][0]["strategy"].startswith("peft+ddp")


def test_public_peft_rows_skips_and_held_out_accuracy():
    """The public PEFT rows: at most 20 skipped as 'not a memfit method'; every PEFT method's held-out
    figures (committed by --write-accuracy) within 10 % median, none more than 10 % under."""
    G = _bench()
    if not G.DEFAULT_FILE.is_file():
        pytest.skip(f"reference runs absent: {G.DEFAULT_FILE}")
    pytest.importorskip("peft")
    skipped = G.load(G.DEFAULT_FILE)[1]
    assert sum("not a memfit method" in s["why"] for s in skipped) <= 20
    methods = json.loads(G.ACCURACY_FILE.read_text())["peft_methods"]
    assert len(methods) >= 25
    for name, m in methods.items():
        assert m["median_abs_pct"] <= 10.0 and m["min_pct"] >= -10.0 and m["under_10"] == 0, name


def test_set_peft_config_on_the_command_line(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps(LOHA))
    run = run_from_dict({"model": "llama-3.2-3b", "peft_config": IA3}, [f"peft_config={tmp_path}"])
    assert run.strategy.method == "peft" and json.loads(run.strategy.peft_config)["peft_type"] == "LOHA"


def test_cli_estimate_takes_a_peft_config(tmp_path):
    """`memfit estimate --peft-config DIR` implies method=peft and prints PEFT's own count."""
    pytest.importorskip("peft")
    (tmp_path / "adapter_config.json").write_text(json.dumps(IA3))
    env = {"PYTHONPATH": ".", "MEMFIT_HWCAL": "off", "MEMFIT_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-m", "memfit", "estimate", "--model", "llama-3.2-3b", "--gpus",
                          "1xL40S-48GB", "--peft-config", str(tmp_path), "--json"], capture_output=True, text=True,
                         env=env, check=True)
    out = json.loads(res.stdout)
    assert out["strategy"]["method"] == "peft" and out["model"]["trainable_parameters"] == 286720
    assert len(list((tmp_path / "cache" / "peft-counts").glob("*.json"))) == 1  # the command saved its count


def test_missing_peft_is_one_line(tmp_path):
    """Without torch / peft installed, method=peft says what to install, on one line."""
    code = ("import sys; sys.modules['peft'] = None; from memfit.estimate import estimate; "
            "from memfit.spec.model import resolve_model; from memfit.spec.hardware import parse_hardware; "
            "from memfit.spec.strategy import Strategy; from memfit.errors import ConfigError\n"
            "try:\n    estimate(resolve_model('llama-3.2-3b'), parse_hardware('1xL40S-48GB'), "
            "Strategy(method='peft', peft_config={'peft_type': 'IA3'}))\n"
            "except ConfigError as err:\n    print(err)")
    env = {"PYTHONPATH": ".", "MEMFIT_HWCAL": "off", "MEMFIT_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.count("\n") == 1 and "peft is missing" in out and "pip install 'memfit[train]'" in out

