"""`memfit train` / `memfit demo` / `python -m memfit.train` end to end (tiny sizes, CPU), and MEFT."""

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from memfit.cli.app import main  # noqa: E402
from memfit.spec.run import load_run, run_from_dict, save_run  # noqa: E402
from memfit.train.demo import make_dialogue_records, write_jsonl  # noqa: E402


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("cli-assets")
    recs = make_dialogue_records(48, seed=2)
    model = tiny_model_dir("cli", [r["dialogue"] + "\n" + r["summary"] for r in recs])
    data = write_jsonl(recs, root / "dialogues.jsonl")
    return model, data


def _cli(capsys, *argv):
    try:
        main(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def _run_file(assets, tmp_path, **strategy):
    model, data = assets
    run = run_from_dict({"model": str(model), "data": {"path": str(data), "eval_fraction": 0.1},
                         "strategy": {"precision": "fp32", "seq_len": 128, "micro_batch_size": 4,
                                      "lora_dropout": 0.0, **strategy},
                         "training": {"max_steps": 6, "learning_rate": 1e-2},
                         "output_dir": str(tmp_path / "out")})
    return save_run(run, tmp_path / "run.yaml")


def test_demo_writes_adapter_metrics_and_run_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "cache"))
    code, out, err = _cli(capsys, "demo", "--out", str(tmp_path / "demo"), "--json",
                          "--set", "max_steps=4", "--set", "strategy.micro_batch_size=2",
                          "--set", "strategy.seq_len=96")
    assert code == 0, err
    result = json.loads(out)
    assert result["steps"] == 4 and result["method"] == "lora"
    demo = tmp_path / "demo"
    assert (demo / "adapter" / "adapter_model.safetensors").is_file()
    assert len([x for x in (demo / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]) == 4
    run = load_run(demo / "run.yaml")
    assert run.strategy.seq_len == 96 and run.training.max_steps == 4
    assert (tmp_path / "cache" / "demo-v1" / "tiny-llama" / "config.json").is_file()


def test_train_command_text_summary(assets, tmp_path, capsys):
    path = _run_file(assets, tmp_path)
    code, out, err = _cli(capsys, "train", str(path), "--set", "lora.r=4", "--set", "training.eval_interval=3")
    assert code == 0, err
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows if "eval_loss" in x] == [3, 6]  # every 3 steps (step 6 is also the final one)
    assert "memfit train — lora — 6 steps" in out
    assert "peak memory" in out and "step time" in out and "saved:" in out
    assert load_run(tmp_path / "out" / "run.yaml").strategy.lora_r == 4
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["eval_loss"] is not None


def test_module_entry_point(assets, tmp_path, capsys):
    from memfit.train.__main__ import main as module_main

    path = _run_file(assets, tmp_path)
    assert module_main([str(path), "--set", "max_steps=2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 2


@pytest.mark.parametrize("argv, needle", [
    (["train", "nope.yaml"], "run file nope.yaml not found"),
    (["train"], "missing RUN_FILE"),
    (["train", "--auto"], "--auto needs --model"),
])
def test_cli_errors_are_one_line_exit_2(capsys, argv, needle):
    code, out, err = _cli(capsys, *argv)
    assert code == 2 and needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_preset_model_and_unrunnable_precision_exit_2(assets, tmp_path, capsys):
    path = _run_file(assets, tmp_path)
    code, _, err = _cli(capsys, "train", str(path), "--set", "model=llama-2-7b")
    assert code == 2 and "no weights" in err
    code, _, err = _cli(capsys, "train", str(path), "--set", "strategy.precision=fp16-mixed")
    assert code == 2 and "fp16-mixed" in err
    assert not (tmp_path / "out" / "adapter").exists()  # nothing written


def test_meft_trains_logs_traffic_and_saves(assets, tmp_path):
    from memfit.train.api import train

    run = load_run(_run_file(assets, tmp_path, method="meft", meft_neurons=256, meft_top_k=16, meft_experts=1),
                   ["max_steps=10"])
    r = train(run)
    assert sum(x for _, x in r.losses[-3:]) < sum(x for _, x in r.losses[:3])
    rows = [json.loads(x) for x in Path(r.metrics_file).read_text().splitlines()]
    assert any(x.get("meft_h2d", 0) > 0 for x in rows if "loss" in x)
    assert (Path(r.saved_to) / "meft_adapter.safetensors").is_file()
    assert r.model["trainable"] == 2 * 256 * 64 * 2  # keys + values, hidden 64, 2 layers


def test_auto_asks_the_planner_then_trains(assets, tmp_path, capsys):
    model, data = assets
    code, out, err = _cli(capsys, "train", "--auto", "--model", str(model), "--data", str(data),
                          "--out", str(tmp_path / "auto"), "--seq-len", "128", "--micro-batch-size", "4",
                          "--methods", "lora", "--set", "max_steps=3", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["method"] == "lora" and result["steps"] == 3
    run = load_run(tmp_path / "auto" / "run.yaml")
    assert run.strategy.seq_len == 128 and run.strategy.precision == "fp32"  # the planner's CPU choice
    assert result["predicted"]["strategy"]["method"] == "lora"
