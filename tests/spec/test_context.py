"""The context guard (#36 item 4, memfit.spec.context): learned positions refused past their table in one line,
RoPE past its trained length allowed with a note naming the length and rope_scaling, the run file's rope_scaling."""

from __future__ import annotations

import pytest

from memfit.errors import ConfigError
from memfit.spec import context
from memfit.spec.model import model_from_config, preset_config, resolve_model
from memfit.spec.run import run_from_dict

SANTACODER_4096 = ("strategy.seq_len=4096 is above santacoder's n_positions=2048: its positions are a learned table "
                   "of 2048 rows (nothing stretches them); use --seq-len 2048 or less (run file: strategy.seq_len)")
LLAMA31_NOTE = ("context: seq_len 524288 is past llama-3.1-8b's trained length 131072 (max_position_embeddings); "
                "RoPE, allowed (the rotations past 131072 are untrained); the config's rope_scaling "
                '{"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, '
                '"original_max_position_embeddings": 8192, "rope_type": "llama3"}; rope_scaling in the run file '
                "(or --rope-scaling) stretches them, e.g. {rope_type: yarn, factor: 4}")


def test_learned_positions_are_refused_past_the_table():
    coder = resolve_model("santacoder")
    assert context.positions(coder) == context.Positions("learned", 2048, "n_positions")
    assert context.refusal(coder, 2048) is None and context.note(coder, 4096) is None
    assert context.refusal(coder, 4096) == SANTACODER_4096
    # a GPT-BigCode config that sizes its table with max_position_embeddings names that field
    cfg = {k: v for k, v in preset_config("santacoder").items() if k != "n_positions"}
    spec = model_from_config({**cfg, "max_position_embeddings": 1024}, name="coder")
    assert context.refusal(spec, 1025).startswith("strategy.seq_len=1025 is above coder's max_position_embeddings=1024")


def test_rope_past_its_length_is_a_note_with_rope_scaling():
    llama = resolve_model("llama-3.1-8b")
    assert context.refusal(llama, 524288) is None
    assert context.note(llama, 131072) is None
    assert context.note(llama, 524288) == LLAMA31_NOTE
    plain = resolve_model("llama-2-7b")  # no rope_scaling in its config
    assert "no rope_scaling in the config" in context.note(plain, 8192)
    mine = context.note(plain, 8192, {"rope_type": "linear", "factor": 2.0})
    assert mine.endswith('the run\'s rope_scaling {"factor": 2.0, "rope_type": "linear"} replaces no '
                         "rope_scaling in the config")
    # transformers 5 writes rope_parameters with rope_type default: that is no scaling
    assert context.config_scaling({"rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}}) is None
    assert context.config_scaling({"rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn", "factor": 2}}) \
        == {"rope_type": "yarn", "factor": 2}
    falcon = model_from_config({**preset_config("falcon-7b"), "alibi": True}, name="falcon-alibi")
    assert "ALiBi" in context.note(falcon, 4096) and context.refusal(falcon, 4096) is None


def test_run_file_rope_scaling_is_checked_and_round_trips():
    run = run_from_dict({"model": "llama-2-7b", "rope_scaling": {"type": "yarn", "factor": 4}})
    assert run.rope_scaling == {"rope_type": "yarn", "factor": 4}
    assert run_from_dict({"model": "llama-2-7b"}).rope_scaling is None
    for bad, needle in [({"rope_type": "ntk"}, "rope_type 'ntk': one of linear, dynamic, yarn, longrope, llama3"),
                        ({"rope_type": "yarn"}, "rope_type yarn needs a positive factor"), ("yarn", "mapping")]:
        with pytest.raises(ConfigError, match=needle):
            run_from_dict({"model": "llama-2-7b", "rope_scaling": bad})
    from memfit.spec.run import dump_run

    assert "rope_scaling" not in dump_run(run_from_dict({"model": "llama-2-7b"}))
    assert "rope_type: yarn" in dump_run(run)


def test_train_guard_and_rope_parameters():
    coder = preset_config("santacoder")
    with pytest.raises(ConfigError, match=r"^strategy\.seq_len=4096 is above santacoder's n_positions=2048"):
        context.train_guard(coder, "santacoder", 4096, None)
    assert context.train_guard(coder, "santacoder", 2048, None) == (2048, [])
    with pytest.raises(ConfigError, match="^rope_scaling: santacoder has learned positions, no RoPE to scale; "
                                          "remove rope_scaling$"):
        context.train_guard(coder, "santacoder", 1024, {"rope_type": "linear", "factor": 2.0})
    llama = preset_config("llama-3.1-8b")
    limit, notes = context.train_guard(llama, "llama-3.1-8b", 524288, None)
    assert limit is None and notes == [LLAMA31_NOTE]
    assert context.rope_parameters(llama, {"rope_type": "yarn", "factor": 4.0}) == \
        {"rope_theta": 500000.0, "rope_type": "yarn", "factor": 4.0}
    v5 = {"rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}}
    assert context.rope_parameters(v5, {"rope_type": "linear", "factor": 2}) == \
        {"rope_theta": 1e4, "rope_type": "linear", "factor": 2}


def test_a_hand_built_spec_without_its_config():
    from dataclasses import replace

    assert context.positions(replace(resolve_model("santacoder"), config_json="")).kind == "learned"
    assert context.positions(replace(resolve_model("llama-2-7b"), config_json="")).kind == "rope"
