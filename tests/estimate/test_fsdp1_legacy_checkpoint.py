"""transformers < 4.52's gradient checkpointing under FSDP1 (``strategy.hf_legacy_checkpoint``): a reentrant
checkpoint around each decoder layer's unit keeps every layer's input and its gradient to the backward's end
(memfit.estimate.fsdp1). Planning only: memfit's trainer refuses it in one line."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from memfit.cli.app import app
from memfit.distributed.preflight import planning_only
from memfit.estimate import estimate
from memfit.estimate import fsdp1 as F1
from memfit.spec.hardware import parse_hardware
from memfit.spec.model import resolve_model
from memfit.spec.run import run_from_dict
from memfit.spec.strategy import Strategy

# the published run the issue quotes: Llama-2-70B QLoRA, 2 x A100-80GB, FSDP1, FA2, checkpointing, 2 x 4096
QLORA_70B = dict(method="qlora", fsdp="full_shard", fsdp_version=1, attention="fa2", seq_len=4096,
                 micro_batch_size=2, lora_r=16, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
                 gradient_checkpointing=True, quant_storage="bf16")


def _allocated(**keys) -> float:
    st = Strategy(**{**QLORA_70B, **keys})
    return estimate(resolve_model("llama-2-70b"), parse_hardware("2xA100-80GB"), st).to_dict()["memory"][
        "gpu_allocated_bytes"]


def test_retained_bytes_by_hand():
    # 4 layers, every input 2 MB: at the first layer's backward the 3 others' inputs and their gradients
    assert F1.reentrant_retained(True, True, act_in=8e6, layers=4) == 2 * 3 * 2e6
    assert F1.reentrant_retained(False, True, act_in=8e6, layers=4) == 0.0  # no checkpointing
    assert F1.reentrant_retained(True, False, act_in=8e6, layers=4) == 0.0  # checkpoint inside each unit


def test_the_70b_run_holds_one_more_copy_of_the_layer_inputs():
    # 80 layers x 2 x 4096 tokens x 8192 x 2 B = 10.74 GB: the inputs of every layer once more (their gradients,
    # while the logits' ~4 GB of the start of backward are gone); the run measured 46.7 GB, 10.3 more than the
    # non-legacy estimate
    plain, legacy = _allocated(), _allocated(hf_legacy_checkpoint=True)
    assert 10.2e9 < legacy - plain < 10.9e9, (plain, legacy)
    assert abs(legacy / 46.7e9 - 1) < 0.02


def test_only_fsdp1_with_checkpointing_is_priced():
    for keys in ({"fsdp": "full_shard", "fsdp_version": 2}, {"fsdp": False}):
        assert _allocated(**keys) == _allocated(**keys, hf_legacy_checkpoint=True)
    # without checkpointing the key means nothing: one form of the strategy
    assert Strategy(hf_legacy_checkpoint=True) == Strategy()
    assert Strategy(gradient_checkpointing=True, hf_legacy_checkpoint=True).label() == "lora+ddp+gc-hf-legacy+sdpa"


def test_cli_flag_and_json():
    r = CliRunner().invoke(app, ["estimate", "--model", "llama-2-70b", "--gpus", "2xA100-80GB", "--method", "qlora",
                                 "--fsdp", "full_shard", "--fsdp-version", "1", "--gradient-checkpointing",
                                 "--hf-legacy-checkpoint", "--seq-len", "4096", "--batch-size", "2", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["strategy"]["hf_legacy_checkpoint"] is True


def test_memfit_trainer_refuses_it_in_one_line():
    run = run_from_dict({"model": "llama-2-7b", "strategy": {"gradient_checkpointing": True,
                                                              "hf_legacy_checkpoint": True}})
    assert planning_only(run) == [
        "strategy.hf_legacy_checkpoint prices transformers < 4.52's reentrant checkpoint around each layer "
        "(planning another stack); memfit trains with transformers 5's checkpoint inside each layer: set it false"]
    assert planning_only(run_from_dict({"model": "llama-2-7b"})) == []
