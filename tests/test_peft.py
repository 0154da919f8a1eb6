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
    st = Strategy(method="peft", peft_config=IA3)
    first = estimate(resolve_model("llama-3.2-3b"), parse_hardware("1xL40S-48GB"), st).trainable_parameters
    assert len(list((tmp_path / "cache" / "peft-counts").glob("*.json"))) == 1
    code = ("import sys; sys.modules['torch'] = None; from memfit.estimate import estimate; "
            "from memfit.spec.model import resolve_model; from memfit.spec.hardware import parse_hardware; "
            "from memfit.spec.strategy import Strategy; import json; "
            f"st = Strategy(method='peft', peft_config=json.loads({json.dumps(json.dumps(IA3))})); "
            "print(estimate(resolve_model('llama-3.2-3b'), parse_hardware('1xL40S-48GB'), st).trainable_parameters)")
    out = subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True, text=True).stdout
    assert float(out.split()[-1]) == first


def _bench():
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import gpu_published

    return gpu_published


def test_published_peft_rows_are_expressed(tmp_path, capsys):
    """bench/gpu_published.py predicts a PEFT row from its peft_config (here IA3 on Mistral-7B)."""
    pytest.importorskip("peft")
    G = _bench()
    row = {"id": "ia3", "source_group": "g", "gpu": {"model": "NVIDIA A100 80GB", "count": 1}, "engine": "single GPU",
           "model": "mistralai/Mistral-7B-v0.1", "method": "ia3", "peft_config": IA3, "precision": "pure bf16",
           "gradient_checkpointing": "no", "sequence_length": {"value": 512}, "micro_batch_size": 2,
           "status": "success", "primary_memory": {"value": 20.0, "unit": "GB", "metric_class": "torch_max_memory_reserved"}}
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


def test_prompt_tuning_time_processes_the_virtual_tokens():
    """PEFT's prompt tuning concatenates num_virtual_tokens embeddings in front of every sequence
    (peft_model.py PeftModelForCausalLM.forward): the step's kernels see seq_len + those, the tokens counted
    are seq_len. 200 virtual tokens at 568 take the compute of 1 at 767 (both 768 positions); tokens/s
    then differ by 568 / 767 (less the optimizer's few microseconds for 199 more trained embeddings)."""
    pytest.importorskip("peft")
    model, hw = resolve_model("llama-3.2-3b"), parse_hardware("1xL40S-48GB")

    def timed(virtual: int, seq: int) -> dict:
        pt = {"peft_type": "PROMPT_TUNING", "num_virtual_tokens": virtual, "task_type": "CAUSAL_LM"}
        return estimate(model, hw, Strategy(method="peft", peft_config=pt, precision="bf16", micro_batch_size=4,
                                            seq_len=seq)).time

    long_prompt, short_prompt = timed(200, 568), timed(1, 767)
    assert long_prompt["compute_seconds"] == pytest.approx(short_prompt["compute_seconds"], rel=1e-12)
    assert long_prompt["tokens_per_second"] / short_prompt["tokens_per_second"] == pytest.approx(568 / 767, rel=1e-3)


def test_delta_weight_methods_time_their_second_linear(monkeypatch):
    """LoHa applies its delta weight with a second F.linear(x, delta_w) beside the base layer
    (peft/tuners/loha/layer.py:266-272), in fp32 under pure bf16 (fp32 adapters, the input cast to them):
    per layer one GEMM of q_proj's shape and one of v_proj's each forward and two each backward, priced as
    the base linears are (memfit.steptime.gemm) at the GPU's plain fp32 rate; and the delta weight, written in the
    forward, its gradient written and read back: 12 B per weight value."""
    pytest.importorskip("peft")
    import memfit.methods.peft as peft_method
    from memfit.steptime import work
    from memfit.steptime.gemm import linear_seconds
    from memfit.steptime.speeds import speeds_for
    from memfit.estimate import DEFAULT_PROFILE

    model, hw = resolve_model("llama-3.2-3b"), parse_hardware("1xL40S-48GB")
    st = Strategy(method="peft", peft_config=LOHA, precision="bf16", micro_batch_size=4, seq_len=210)
    work_ = peft_method.METHOD.extra_layer_work(model, st, frozenset())
    assert work_["delta_linears"] == ((3072.0, 3072.0, 1.0, True, True), (3072.0, 1024.0, 1.0, True, True))
    assert work_["weight_bytes"] == 12.0 * (3072 * 3072 + 3072 * 1024)
    with_delta = estimate(model, hw, st).time["matmul_seconds"]
    monkeypatch.setattr(peft_method.Peft, "extra_layer_work", lambda self, m, s, a: {})
    work._PER_MODEL.clear()
    without = estimate(model, hw, st).time["matmul_seconds"]
    work._PER_MODEL.clear()
    g = speeds_for(hw, "bf16", "sdpa", DEFAULT_PROFILE).gpu
    extra = 0.0
    for k, n in ((3072, 3072), (3072, 1024)):
        fwd, bwd = linear_seconds(4 * 210, k, n, g, True, 4.0, True)
        extra += 28 * (fwd + bwd)
    assert with_delta - without == pytest.approx(extra, rel=1e-9)
    assert extra > 0.02  # fp32 GEMMs of 840 tokens: tens of milliseconds per step, not a rounding error


def test_boft_times_its_rotation(monkeypatch):
    """BOFT (peft/tuners/boft/layer.py Linear.forward:594-650, one butterfly factor) builds an in x in rotation
    each forward — bmm(block_diag, P.T), bmm(P, .), @ eye: three in x in x in GEMMs in the input's dtype, and
    three in backward (each product with a trained operand) — then x @ rotation, a linear of in x in whose
    weight trains. q_proj and v_proj of Llama-3.2-3B both take in = 3072."""
    pytest.importorskip("peft")
    import memfit.methods.peft as peft_method
    from memfit.estimate import DEFAULT_PROFILE
    from memfit.steptime import work
    from memfit.steptime.gemm import gemm_seconds, linear_seconds
    from memfit.steptime.speeds import speeds_for

    model, hw = resolve_model("llama-3.2-3b"), parse_hardware("1xL40S-48GB")
    boft = {"peft_type": "BOFT", "boft_block_size": 4, "boft_n_butterfly_factor": 1,
            "target_modules": ["q_proj", "v_proj"]}
    st = Strategy(method="peft", peft_config=boft, precision="bf16", micro_batch_size=4, seq_len=210)
    work_ = peft_method.METHOD.extra_layer_work(model, st, frozenset())
    assert work_["weight_gemms"] == ((3072.0, 3072.0, 3072.0, 3.0, 3.0, 1.0),) * 2
    assert work_["delta_linears"] == ((3072.0, 3072.0, 1.0, False, True),) * 2
    with_rotation = estimate(model, hw, st).time["matmul_seconds"]
    monkeypatch.setattr(peft_method.Peft, "extra_layer_work", lambda self, m, s, a: {})
    work._PER_MODEL.clear()
    without = estimate(model, hw, st).time["matmul_seconds"]
    work._PER_MODEL.clear()
    g = speeds_for(hw, "bf16", "sdpa", DEFAULT_PROFILE).gpu
    fwd, bwd = linear_seconds(4 * 210, 3072, 3072, g, True, 2.0, False)
    per_linear = 6 * gemm_seconds(3072, 3072, 3072, g, 2.0) + fwd + bwd
    assert with_rotation - without == pytest.approx(28 * 2 * per_linear, rel=1e-9)


def test_randlora_times_its_full_rank_bases(monkeypatch):
    """RandLoRA (peft/tuners/randlora/layer.py forward:327-344, get_scaled_bases:262-308) adds
    F.linear(F.linear(x, first), second) of rank r x ceil(min(in, out) / r) in fp32, its random bases frozen
    and only the one on the smaller side scaled by the trained lambda / gamma. r = 32 on q_proj (3072 -> 3072:
    rank 3072, the first basis trains) and v_proj (3072 -> 1024: rank 1024, the second trains)."""
    pytest.importorskip("peft")
    import memfit.methods.peft as peft_method
    from memfit.estimate import DEFAULT_PROFILE
    from memfit.steptime import work
    from memfit.steptime.gemm import linear_seconds
    from memfit.steptime.speeds import speeds_for

    model, hw = resolve_model("llama-3.2-3b"), parse_hardware("1xL40S-48GB")
    cfg = {"peft_type": "RANDLORA", "r": 32, "target_modules": ["q_proj", "v_proj"]}
    st = Strategy(method="peft", peft_config=cfg, precision="bf16", micro_batch_size=4, seq_len=210)
    linears = peft_method.METHOD.extra_layer_work(model, st, frozenset())["delta_linears"]
    assert sorted(linears) == sorted([(3072.0, 3072.0, 1.0, True, True), (3072.0, 3072.0, 1.0, True, False),
                                      (3072.0, 1024.0, 1.0, True, False), (1024.0, 1024.0, 1.0, True, True)])
    with_bases = estimate(model, hw, st).time["matmul_seconds"]
    monkeypatch.setattr(peft_method.Peft, "extra_layer_work", lambda self, m, s, a: {})
    work._PER_MODEL.clear()
    without = estimate(model, hw, st).time["matmul_seconds"]
    work._PER_MODEL.clear()
    g = speeds_for(hw, "bf16", "sdpa", DEFAULT_PROFILE).gpu
    extra = sum(28 * sum(linear_seconds(4 * 210, k, n, g, trains, 4.0, True)) for k, n, _, _, trains in linears)
    assert with_bases - without == pytest.approx(extra, rel=1e-9)


def test_osf_times_its_rank_2r_update():
    """OSF (peft/tuners/osf/layer.py forward:316-350) adds F.linear(F.linear(x, B), A), A and B the trained
    low-rank factors concatenated with their frozen initial copies: rank 2r. The MetaMathQA config keeps
    2944 of q_proj's 3072 directions (896 of k_proj's 1024) frozen, so r = 128 and each wrapped linear gets two
    fp32 linears of rank 256 whose weights train."""
    pytest.importorskip("peft")
    import memfit.methods.peft as peft_method

    cfg = {"peft_type": "OSF", "target_modules": ["q_proj", "k_proj"], "rank_pattern": {"q_proj": 2944, "k_proj": 896}}
    st = Strategy(method="peft", peft_config=cfg, precision="bf16", micro_batch_size=4, seq_len=210)
    linears = peft_method.METHOD.extra_layer_work(resolve_model("llama-3.2-3b"), st, frozenset())["delta_linears"]
    shapes = sorted((round(k), round(n)) for k, n, share, f32, trains in linears if share == 1.0 and f32 and trains)
    assert len(linears) == 4 and shapes == sorted([(3072, 256), (256, 3072), (3072, 256), (256, 1024)])
