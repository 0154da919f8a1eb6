"""The train summary predicts the step at the padded shapes the run trained (memfit.train.shapes)."""

import json
from statistics import median

import pytest

from memfit.resolve import predict
from memfit.spec.run import run_from_dict
from memfit.train.shapes import predict_as_ran


def _at(run, rows, length, accum):
    """memfit.resolve.predict of ``run`` at one micro-batch shape, by hand."""
    st = run.strategy.model_copy(update={"micro_batch_size": rows, "seq_len": length, "grad_accum": accum})
    return predict(run.model_copy(update={"strategy": st})).time["step_seconds"]


def _preset_run(**distributed):
    return run_from_dict({"model": "llama-3.2-1b", "hardware": "1xA100-80GB",
                          "strategy": {"micro_batch_size": 4, "seq_len": 512, "grad_accum": 2},
                          "distributed": distributed or {"nproc": 1}})


def test_each_step_is_predicted_at_its_shapes_and_the_median_taken():
    run = _preset_run()
    planned = predict(run).to_dict()
    steps = [((4, 100), (4, 200)), ((4, 300), (4, 512)), ((4, 64), (4, 64)), ((3, 128),)]
    got = predict_as_ran(run, [steps], planned)
    per_step = [(_at(run, 4, 300, 2) + _at(run, 4, 512, 2)) / 2, _at(run, 4, 64, 2), _at(run, 3, 128, 1)]
    assert got["step_seconds"] == pytest.approx(median(per_step), rel=1e-12)  # the first step is warm-up
    assert got["shape"] == "padded" and got["planned_step_seconds"] == planned["time"]["step_seconds"]
    assert got["padded"]["median_len"] == 128 and got["padded"]["max_len"] == 512
    assert got["padded"]["median_padded_tokens_per_step"] == 4 * 64 * 2  # of 4·300 + 4·512, 4·64 · 2, 3·128
    assert got["basis"].startswith("at the data's padded lengths (median 128, max 512 of planned 512")
    assert "planned shape 4 × 512" in got["memory_basis"]


def test_several_ranks_take_the_slowest_rank_per_step():
    run = _preset_run(nproc=2)
    planned = predict(run).to_dict()
    rank0 = [((4, 64),), ((4, 64),), ((4, 400),), ((4, 64),)]
    rank1 = [((4, 64),), ((4, 300),), ((4, 100),), ((4, 64),)]
    rank0 = [tuple(s * 2) for s in rank0]  # grad_accum 2: two equal micro-batches per step
    rank1 = [tuple(s * 2) for s in rank1]
    got = predict_as_ran(run, [rank0, rank1], planned)
    assert got["step_seconds"] == pytest.approx(median([_at(run, 4, 300, 2), _at(run, 4, 400, 2),
                                                        _at(run, 4, 64, 2)]), rel=1e-12)
    assert "slowest of 2 ranks" in got["basis"]


def test_full_batches_coincide_with_the_plan():
    run = _preset_run()
    planned = predict(run).to_dict()
    got = predict_as_ran(run, [[((4, 512), (4, 512))] * 3], planned)
    assert got["shape"] == "planned" and got["step_seconds"] == planned["time"]["step_seconds"]
    assert predict_as_ran(run, [[(), ()]], planned) is None  # no shapes recorded: no second figure
    assert predict_as_ran(run, [[((4, 512),)]], None) is None


torch = pytest.importorskip("torch")
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_model_dir):
    from memfit.train.demo import make_dialogue_records, write_jsonl

    root = tmp_path_factory.mktemp("padded")
    recs = make_dialogue_records(8, seed=3)
    model = tiny_model_dir("padded", [r["dialogue"] + "\n" + r["summary"] for r in recs])
    return model, write_jsonl(recs, root / "dialogues.jsonl"), recs


def _tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


def test_summary_predicts_the_recorded_padded_lengths(assets, tmp_path, capsys):
    """micro-batch 1 × accumulation 2 over 8 examples for 4 steps: one epoch, each example once, so the
    recorded lengths are the examples' token counts; the step figure is resolve.predict at them."""
    from cli_helper import run_cli
    from memfit.spec.run import save_run
    from memfit.train.data import tokenize_example

    model, data, recs = assets
    lengths = sorted(len(tokenize_example(r, "dialogue_summary", _tokenizer(model), 128)[0]) for r in recs)
    assert lengths[0] < lengths[-1] < 128
    run = run_from_dict({"model": str(model), "data": {"path": str(data), "eval_fraction": 0.0},
                         "strategy": {"precision": "fp32", "seq_len": 128, "micro_batch_size": 1, "grad_accum": 2,
                                      "lora_r": 4, "lora_dropout": 0.0},
                         "training": {"max_steps": 4, "learning_rate": 1e-2, "logging_interval": 1},
                         "output_dir": str(tmp_path / "out")})
    code, out, err = run_cli(capsys, "train", str(save_run(run, tmp_path / "run.yaml")), "--json")
    assert code == 0, err
    result = json.loads(out)
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    padded = [x["padded_tokens"] for x in rows if "loss" in x]
    assert len(padded) == 4 and sum(padded) == sum(lengths)  # rows of 1: no padding at all
    step = result["predicted_step"]
    assert {"step_seconds", "basis", "shape", "planned_step_seconds", "planned_shape", "padded",
            "memory_basis"} <= set(step)
    assert step["planned_step_seconds"] == result["predicted"]["time"]["step_seconds"]
    assert step["planned_shape"] == "1 × 128" and step["shape"] == "padded"
    assert step["padded"]["steps"] == 3 and step["padded"]["micro_batches"] == 6
    # the timed steps (2-4) hold six of the eight examples; step 1's two are the others
    assert step["padded"]["min_len"] >= lengths[0] and step["padded"]["max_len"] <= lengths[-1]
    assert lengths[0] <= step["padded"]["median_len"] <= lengths[-1]
    by_hand = [_at(run, 1, w, 2) for w in lengths]
    assert min(by_hand) <= step["step_seconds"] <= max(by_hand) < step["planned_step_seconds"]
    from rich.console import Console

    from memfit.cli.train_view import print_summary, summary_table

    wide = Console(width=200, record=True)
    wide.print(summary_table(result))
    table = wide.export_text()
    assert f"predicted at padded length {step['padded']['median_len']:g} " in table
    assert "predicted at planned 1 × 128 " in table
    print_summary(result)
    text = " ".join(capsys.readouterr().out.split())
    assert f"predicted step time: at the data's padded lengths (median {step['padded']['median_len']:g}" in text


def test_recorded_shapes_and_prediction_by_hand(assets, tmp_path, monkeypatch):
    """Through the library: the per-step shapes equal the examples' lengths, and the step figure is the
    median over steps 2-4 of resolve.predict at each step's two lengths."""
    from memfit.train import api, callbacks

    model, data, recs = assets
    seen: list = []

    class Keep(callbacks.StepStats):  # the trainer's own StepStats, kept for the test
        def on_train_end(self, *a, **kw):
            seen.append(self.batches)

    monkeypatch.setattr(callbacks, "StepStats", Keep)

    run = run_from_dict({"model": str(model), "data": {"path": str(data), "eval_fraction": 0.0},
                         "strategy": {"precision": "fp32", "seq_len": 128, "micro_batch_size": 1, "grad_accum": 2,
                                      "lora_r": 4, "lora_dropout": 0.0},
                         "training": {"max_steps": 4, "learning_rate": 1e-2},
                         "output_dir": str(tmp_path / "out")})
    result = api.train(run)
    from memfit.train.data import tokenize_example

    lengths = sorted(len(tokenize_example(r, "dialogue_summary", _tokenizer(model), 128)[0]) for r in recs)
    steps = seen[0]
    assert [len(s) for s in steps] == [2, 2, 2, 2] and all(r == 1 for s in steps for r, _ in s)
    assert sorted(w for s in steps for _, w in s) == lengths
    want = median((_at(run, 1, a, 2) + _at(run, 1, b, 2)) / 2 for (_, a), (_, b) in steps[1:])
    assert result.predicted_step["step_seconds"] == pytest.approx(want, rel=1e-12)


def test_packed_full_rows_predict_the_planned_shape(assets, tmp_path):
    """Packing fills rows to seq_len: with examples of L tokens and seq_len = 4 L every batch is full,
    and the step predicted as it ran is the planned one."""
    from memfit.train.api import train
    from memfit.train.data import tokenize_example
    from memfit.train.demo import write_jsonl

    model, _, _ = assets
    rec = {"text": "Anna: Can we meet at noon? Ben: Sure."}
    n = len(tokenize_example(rec, "text", _tokenizer(model), 128)[0])
    seq_len = (128 // n) * n
    path = write_jsonl([rec] * (4 * (128 // n)), tmp_path / "same.jsonl")
    run = run_from_dict({"model": str(model),
                         "data": {"path": str(path), "eval_fraction": 0.0, "packing": True, "format": "text"},
                         "strategy": {"precision": "fp32", "seq_len": seq_len, "micro_batch_size": 2,
                                      "lora_r": 4, "lora_dropout": 0.0},
                         "training": {"max_steps": 3, "learning_rate": 1e-2},
                         "output_dir": str(tmp_path / "out")})
    result = train(run)
    step = result.predicted_step
    assert result.data["packed_sequences"] == 4
    assert step["shape"] == "planned" and step["padded"]["median_len"] == step["padded"]["max_len"] == seq_len
    assert step["step_seconds"] == result.predicted["time"]["step_seconds"] == step["planned_step_seconds"]
