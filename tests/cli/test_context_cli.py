"""The context guard on the command line (#36 item 4): estimate and plan refuse a learned-position model past
its table in the one line memfit.spec.context words; a RoPE model past its trained length plans with the note
(in the table, in --json's "notes" / "why")."""

from __future__ import annotations

import json

from cli_helper import run_cli
from memfit.plan import rules
from memfit.plan.search import rule_key
from memfit.plan.space import enumerate_strategies
from memfit.spec.hardware import parse_hardware
from memfit.spec.model import resolve_model
from tests.spec.test_context import LLAMA31_NOTE, SANTACODER_4096


def test_estimate_and_plan_refuse_santacoder_past_its_positions(capsys):
    code, out, err = run_cli(capsys, "estimate", "--model", "santacoder", "--seq-len", "4096", "--gpus",
                             "1xA100-80GB", "--method", "lora")
    assert code == 2 and out == ""
    assert err == f"error: {SANTACODER_4096}\n"
    code, out, err = run_cli(capsys, "plan", "--model", "santacoder", "--seq-len", "4096", "--gpus", "1xA100-80GB")
    assert code == 2 and err == f"error: no combination can run here: {SANTACODER_4096}\n"
    code, out, err = run_cli(capsys, "plan", "--model", "santacoder", "--seq-len", "4096", "--gpu", "A100-80GB",
                             "--max-gpus", "2")
    assert code == 2 and err == f"error: {SANTACODER_4096}\n"
    code, out, _ = run_cli(capsys, "estimate", "--model", "santacoder", "--seq-len", "2048", "--gpus",
                           "1xA100-80GB", "--method", "lora", "--json")
    assert code == 0 and json.loads(out)["notes"] == []


def test_rope_past_its_length_plans_with_the_note(capsys):
    code, out, err = run_cli(capsys, "plan", "--model", "llama-3.1-8b", "--gpus", "8xH100-80GB", "--seq-len",
                             "524288", "--json")
    assert code == 0, err
    assert json.loads(out)["why"][-1] == LLAMA31_NOTE
    code, out, err = run_cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "8xH100-80GB", "--seq-len",
                             "524288", "--method", "lora", "--zero", "3", "--json")
    assert code == 0, err
    assert json.loads(out)["notes"] == [LLAMA31_NOTE]
    code, out, err = run_cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "8xH100-80GB", "--seq-len",
                             "524288", "--method", "lora", "--zero", "3")
    assert code == 0, err
    assert "note: context: seq_len 524288 is past llama-3.1-8b's trained length 131072" in " ".join(out.split())


def test_the_rule_memo_keys_the_length_for_learned_positions_only():
    """The matrix shares rule verdicts across lengths (search.rule_key): a learned-position model's verdict
    depends on the length, a RoPE model's does not."""
    hw = parse_hardware("1xA100-80GB")
    coder, llama = resolve_model("santacoder"), resolve_model("llama-3.1-8b")
    s = next(iter(enumerate_strategies(coder, hw, seq_len=1024, micro_batch_size=1)))
    long = s.model_copy(update={"seq_len": 4096})
    assert rule_key(s, coder) != rule_key(long, coder)
    assert rules.check(coder, hw, s) == [] and rules.check(coder, hw, long) == [SANTACODER_4096]
    assert rule_key(s, llama) == rule_key(long, llama)
    assert rules.check(llama, hw, long) == rules.check(llama, hw, s)


def test_rope_scaling_flag_names_it_and_emit_writes_it(capsys, tmp_path):
    """--rope-scaling (the run file's rope_scaling on the command line): the note names it, plan --emit writes it
    into run.yaml, a model without RoPE and a malformed mapping are one line."""
    from memfit.spec.run import load_run

    scaling = ['--rope-scaling', '{rope_type: yarn, factor: 2.0}']
    code, out, err = run_cli(capsys, "plan", "--model", "llama-2-7b", "--gpus", "8xH100-80GB", "--seq-len",
                             "8192", *scaling, "--emit", str(tmp_path / "emit"), "--json")
    assert code == 0, err
    assert json.loads(out)["why"][-1] == (
        "context: seq_len 8192 is past llama-2-7b's trained length 4096 (max_position_embeddings); RoPE, allowed; "
        'the run\'s rope_scaling {"factor": 2.0, "rope_type": "yarn"} replaces no rope_scaling in the config')
    code, out, err = run_cli(capsys, "estimate", "--model", "llama-3.1-8b", "--gpus", "8xH100-80GB", "--seq-len",
                             "262144", "--method", "lora", *scaling, "--json")
    assert json.loads(out)["notes"][0].endswith('the run\'s rope_scaling {"factor": 2.0, "rope_type": "yarn"} '
                                                'replaces the config\'s rope_scaling {"factor": 8.0, "high_freq_factor"'
                                                ': 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": '
                                                '8192, "rope_type": "llama3"}')
    assert load_run(tmp_path / "emit" / "run.yaml").rope_scaling == {"rope_type": "yarn", "factor": 2.0}
    code, out, err = run_cli(capsys, "estimate", "--model", "llama-2-7b", "--gpus", "1xA100-80GB", "--seq-len",
                             "8192", "--method", "lora", *scaling, "--json")
    assert code == 0 and "the run's rope_scaling" in json.loads(out)["notes"][0]
    for model, text, line in [
        ("santacoder", scaling[1], "error: rope_scaling: santacoder has learned positions, no RoPE to scale; "
                                   "remove rope_scaling\n"),
        ("llama-2-7b", "yarn", "error: --rope-scaling 'yarn': must be a mapping such as {rope_type: yarn, "
                               "factor: 4.0} (rope_type: linear, dynamic, yarn, longrope, llama3)\n"),
        ("llama-2-7b", "{a: [1", "error: --rope-scaling '{a: [1': not YAML / JSON (expected ',' or ']', but got "
                                 "'<stream end>'); give a mapping such as '{rope_type: yarn, factor: 4.0}'\n")]:
        code, out, err = run_cli(capsys, "estimate", "--model", model, "--gpus", "1xA100-80GB", "--rope-scaling", text)
        assert (code, err) == (2, line)
