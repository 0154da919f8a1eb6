"""Run phases (#39): loading, the training step, evaluation and the checkpoint save, each priced per GPU and per
node; the verdict holds the largest, --json and the table say which sets the peak (memfit.estimate.phases)."""

import json

import pytest

from memfit.errors import ConfigError
from memfit.estimate import estimate
from memfit.spec.hardware import parse_hardware
from memfit.spec.model import resolve_model
from memfit.spec.phases import RunPhases, save_mode
from memfit.spec.run import run_from_dict
from memfit.spec.strategy import Strategy
from tests.cli_helper import run_cli

L8 = resolve_model("llama-3.1-8b")
A100 = parse_hardware("1xA100-80GB")
LORA = Strategy(method="lora", gradient_checkpointing=True, seq_len=2048, micro_batch_size=2)


def _phases(**kw) -> RunPhases:
    return RunPhases(**kw)


def test_every_phase_priced_and_the_verdict_holds_the_largest():
    est = estimate(L8, A100, LORA)
    d = est.to_dict()["memory"]
    assert set(d["run_phases"]) == {"load", "train_step", "eval", "save"}
    gpus = {k: v["gpu_bytes"] for k, v in d["run_phases"].items()}
    cpus = {k: v["cpu_bytes"] for k, v in d["run_phases"].items()}
    assert d["gpu_needed_bytes"] == max(gpus.values()) and d["gpu_peak_phase"] == "train_step"
    assert d["cpu_bytes"]["total"] == max(cpus.values())
    # the existing keys stay: the step's lines, nvidia-smi total, the CPU lines
    assert d["gpu_bytes"]["total"] > 0 and "model_loading" in d["cpu_bytes"] and d["cpu_peak_phase"] == "loading"
    # evaluation at the training batch holds less than the step (no gradients, nothing saved for backward)
    assert gpus["eval"] < gpus["train_step"] and d["phase_settings"] == {
        "eval": {"enabled": True, "batch_size": 2, "loss_only": True, "accumulation_steps": None, "examples": None},
        "save": {"mode": "adapter"}}


def test_a_run_that_evaluates_nothing_has_no_evaluation_phase():
    """eval.enabled: false (memfit train then drops its evaluation data): the phase is neither priced nor held."""
    big = _phases(eval={"batch_size": 64})
    off = estimate(L8, A100, LORA, phases=_phases(eval={"batch_size": 64, "enabled": False}))
    assert not estimate(L8, A100, LORA, phases=big).fits and off.fits
    assert set(off.to_dict()["memory"]["run_phases"]) == {"load", "train_step", "save"}
    assert off.to_dict()["memory"]["phase_settings"]["eval"]["enabled"] is False


def test_a_larger_evaluation_batch_sets_the_peak():
    """transformers#12878 / LLaMA-Factory#1595: evaluation runs out of memory while training fits."""
    small = estimate(L8, A100, LORA)
    big = estimate(L8, A100, LORA, phases=_phases(eval={"batch_size": 64}))
    assert big.phases["train_step"] == small.phases["train_step"]
    assert big.gpu_phase == "eval" and big.gpu_needed == big.phases["eval"][0] > small.gpu_needed
    assert not big.fits and any(r.startswith("GPU memory while evaluation: needs") for r in big.reasons)


def test_kept_logits_are_priced_and_need_the_example_count():
    """prediction_loss_only off: every batch's logits gathered from all ranks stay on the GPU, then on the CPU."""
    with pytest.raises(ConfigError, match="eval.examples"):
        estimate(L8, A100, LORA, phases=_phases(eval={"loss_only": False}))
    loss = estimate(L8, A100, LORA)
    kept = estimate(L8, A100, LORA, phases=_phases(eval={"loss_only": False, "examples": 10}))
    batches, one = 5, 2 * 2048 * L8.vocab * 2.0  # 10 sequences at 2 per batch on one GPU; a batch's logits
    # EvalLoopContainer concatenates each batch onto the kept ones: the last add holds 2 x 5 batches, in place of
    # the forward's own peak (under one batch here)
    more = kept.phases["eval"][0] - loss.phases["eval"][0]
    assert 0 < more < 2 * batches * one * 1.04  # less the loss phase's own logits terms (5.3 GB), no longer the peak
    twice = estimate(L8, A100, LORA, phases=_phases(eval={"loss_only": False, "examples": 20}))
    assert twice.phases["eval"][0] - kept.phases["eval"][0] == pytest.approx(2 * batches * one * 1.04, rel=1e-6)
    assert kept.phases["eval"][1] - loss.phases["eval"][1] == pytest.approx(10 * 2048 * L8.vocab * 4.0)


def test_full_save_under_fsdp_gathers_the_state_dict_on_rank_0():
    """memfit train's final save under FSDP is accelerate's full state dict on rank 0's CPU (pytorch#137151);
    an adapter save holds the trained parameters only."""
    hw = parse_hardware("4xA100-80GB", cpu_ram="512GB")
    st = Strategy(method="lora", fsdp="full_shard", fsdp_version=1, gradient_checkpointing=True, seq_len=2048)
    assert save_mode(st) == "full" and save_mode(LORA) == "adapter" and save_mode(st, "sharded") == "sharded"
    full = estimate(resolve_model("llama-3.1-70b"), hw, st)
    adapter = estimate(resolve_model("llama-3.1-70b"), hw, st, phases=_phases(save={"mode": "adapter"}))
    steady = full.phases["train_step"][1]
    assert full.phases["save"][1] - steady > 140e9  # the 16-bit base + fp32 adapters
    assert adapter.phases["save"][1] - steady == pytest.approx(4 * 4.0 * adapter.trainable_parameters, rel=0.01)
    # (every rank gathers the fp32 adapter: 4 x 0.83 GB)
    assert full.cpu_phase == "saving" and adapter.cpu_phase == "loading"
    assert full.phases["save"][0] > adapter.phases["save"][0]  # one unit unsharded on the GPU while gathering


def test_fsdp1_offload_first_step_holds_the_unpinned_shards():
    """init_flat_param_attributes pins a copy of each shard; the unpinned one stays the flat parameter's data
    until the unit's first pre-unshard: both live at the start of the first step."""
    st = Strategy(method="qlora", fsdp="full_shard", fsdp_version=1, offload="optimizer+params",
                  gradient_checkpointing=True, seq_len=2048, quant_storage="bf16")
    est = estimate(resolve_model("llama-2-70b"), parse_hardware("2xRTX3090-24GB", cpu_ram="256GB"), st,
                   phases=_phases(save={"mode": "adapter"}))
    shards = est.phases["load"][1] - est.phases["train_step"][1]
    # two ranks' unpinned shards of the 70B NF4 model (~37 GB in all: one copy per node, exact sizes)
    assert 35e9 < shards < 40e9 and est.cpu_phase == "loading"


def test_run_file_keys_reach_the_estimate():
    run = run_from_dict({"model": "llama-3.2-1b", "hardware": "1xA100-80GB", "eval": {"batch_size": 8},
                         "save": {"mode": "full"}})
    from memfit.resolve import predict

    est = predict(run)
    assert est.phase_settings["eval"]["batch_size"] == 8 and est.phase_settings["save"]["mode"] == "full"
    with pytest.raises(ConfigError, match="save"):
        run_from_dict({"model": "llama-3.2-1b", "save": {"mode": "everything"}})


def test_cli_flags_table_and_json(capsys):
    args = ("estimate", "-m", "llama-3.1-8b", "--gpus", "1xA100-80GB", "--method", "lora", "--seq-len", "2048",
            "--gradient-checkpointing")
    code, out, _ = run_cli(capsys, *args, "--eval-batch-size", "64")
    assert code == 0 and "run phases" in out and "sets the GPU peak" in out and "evaluation (b 64" in out
    code, out, _ = run_cli(capsys, *args, "--save-mode", "sharded", "--json")
    assert json.loads(out)["memory"]["phase_settings"]["save"]["mode"] == "sharded"
    code, _, err = run_cli(capsys, *args, "--eval-keep-logits")
    assert code == 2 and "eval.examples" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(capsys, *args, "--save-mode", "everything")
    assert code == 2 and err.startswith("error: --save-mode") and len(err.strip().splitlines()) == 1
