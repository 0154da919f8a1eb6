"""`memfit ui`'s page, called as the page calls it (memfit.ui.handlers), without a browser: every number
equals `memfit plan --json`'s for the same inputs, the downloads equal `plan --emit`'s files byte for byte,
bad inputs come back as one inline line, the run list and reports, and the planner side stays torch-free.
The page in a real browser: tests/ui/test_ui_browser.py."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pandas")

from cli_helper import run_cli  # noqa: E402
from memfit.methods import PLANNED  # noqa: E402
from memfit.spec.model import preset_config  # noqa: E402
from memfit.ui import handlers  # noqa: E402
from memfit.ui.compute import plan_json  # noqa: E402
from memfit.ui.form import Form  # noqa: E402
from memfit.ui.handlers import FIELDS  # noqa: E402


def values(**kw) -> tuple:
    """The page's control values in FIELDS order: the page's defaults, overridden by ``kw``."""
    form = Form(**kw)
    return tuple(getattr(form, name) for name in FIELDS)


def cli_for(out: handlers.PlanOutput, capsys, emit: Path) -> tuple[dict, list[str]]:
    """What `memfit plan --json --emit DIR` prints for the page's own command line."""
    args = shlex.split(out.command)
    assert args[:2] == ["memfit", "plan"] and args[-2:] == ["--emit", "run-config/"]
    code, stdout, err = run_cli(capsys, *args[1:-2], "--emit", str(emit), "--json")
    assert code == 0, err
    d = json.loads(stdout)
    return d, d.pop("emitted")


CASES = {
    "the issue's form": dict(preset="llama-2-7b", gpu="RTX4090-24GB", count=2, seq_len=2048),
    "every input changed": dict(preset="qwen2.5-7b", gpu="A100-80GB", count=4, nodes=2, cpu_ram_gb=256,
                                seq_len=1024, micro_batch=2, grad_accum=4, methods=["lora", "qlora"],
                                margin=0.1),
    "deepspeed": dict(preset="llama-2-13b", gpu="V100-32GB", count=8, seq_len=512, methods=["full"]),
    # the long-context levers (#36), fixed on the page as --sequence-parallel / --activation-offload / --tiled-mlp
    "long-context levers": dict(preset="llama-3.1-8b", gpu="H100-80GB", count=8, seq_len=262144,
                                sequence_parallel=8, activation_offload="checkpointed", tiled_mlp="on"),
    "context parallel": dict(preset="llama-3.1-8b", gpu="H100-80GB", count=8, seq_len=131072,
                             context_parallel=4, tiled_mlp="off"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_page_equals_plan_json_and_emit(case, tmp_path, capsys):
    out = handlers.plan_page(tmp_path / "work", *values(**CASES[case]))
    assert out.message == "", out.message
    cli, emitted = cli_for(out, capsys, tmp_path / "emit")
    page = json.loads(plan_json(out.plan))
    assert page == cli  # every number of plan --json, exactly (floats compared exactly)
    assert out.headline.startswith("Recommended: ")
    rec = cli["recommended"]
    assert f"{rec['time']['step_seconds']:.3f} s/step" in out.headline
    assert f"{rec['memory']['gpu_bytes']['total'] / 1e9:.2f} GB" in out.headline
    downloads = {Path(p).name: Path(p).read_bytes() for p in out.files}
    for path in map(Path, emitted):  # run.yaml + deepspeed.json / accelerate.yaml, byte for byte
        assert downloads[path.name] == path.read_bytes(), path.name
    assert json.loads(downloads["plan.json"]) == cli
    assert downloads["command.txt"].decode().strip() == out.command
    # the pictures hold the same numbers
    fits = out.scatter[out.scatter["verdict"] == "fits"]
    assert len(fits) == len(cli["candidates"])
    assert sorted(fits["s/step"]) == sorted(c["time"]["step_seconds"] for c in cli["candidates"])
    first = out.bars[out.bars["plan"] == out.bars["plan"].iloc[0]]
    capacity = rec["hardware"]["gpu_memory_bytes"] / 1e9
    assert first["GB"].sum() == pytest.approx(capacity, rel=1e-9)
    used = first[~first["component"].isin(["free", "margin"])]["GB"].sum()
    assert used == pytest.approx(rec["memory"]["gpu_bytes"]["total"] / 1e9, rel=1e-9)
    assert out.runner_ups["s/step"].iloc[0] == round(rec["time"]["step_seconds"], 4)


def test_the_levers_reach_the_command_and_the_rope_note_the_page(tmp_path):
    out = handlers.plan_page(tmp_path, *values(**CASES["long-context levers"]), files=False)
    assert out.command.endswith("--seq-len 262144 --batch-size 1 --sequence-parallel 8 --activation-offload "
                                "checkpointed --tiled-mlp --emit run-config/")
    rec = out.plan["recommended"]["strategy"]
    assert (rec["sequence_parallel"], rec["activation_offload"], rec["tiled_mlp"]) == (8, "checkpointed", True)
    assert out.plan["why"][-1].startswith("context: seq_len 262144 is past llama-3.1-8b's trained length 131072")
    assert "trained length 131072" in out.text  # shown under Why
    assert "--context-parallel 4 --no-tiled-mlp" in handlers.plan_page(
        tmp_path, *values(**CASES["context parallel"]), files=False).command
    liger = handlers.plan_page(tmp_path, *values(**CASES["long-context levers"], liger="on"), files=False)
    assert "--tiled-mlp --liger --emit" in liger.command
    assert liger.plan["recommended"]["strategy"]["liger"] is True


def test_run_yaml_reads_back_with_memfits_loader(tmp_path):
    from memfit.spec.run import load_run

    out = handlers.plan_page(tmp_path, *values(count=2, seq_len=2048))
    run = load_run(next(p for p in out.files if p.endswith("run.yaml")))
    assert run.strategy.model_dump(mode="json") == {**out.plan["recommended"]["strategy"],
                                                    "lora_targets": run.strategy.model_dump(mode="json")[
                                                        "lora_targets"]}
    assert run.hardware == "2xRTX4090-24GB" and run.model == "llama-2-7b"


def test_pasted_and_uploaded_config_plan_like_the_file(tmp_path, capsys):
    text = json.dumps(preset_config("llama-3.2-1b"))
    pasted = handlers.plan_page(tmp_path, *values(source="config.json", config_text=text, seq_len=1024))
    upload = tmp_path / "upload.json"
    upload.write_text(text)
    uploaded = handlers.plan_page(tmp_path, *values(source="config.json", config_file=str(upload), seq_len=1024))
    assert pasted.message == uploaded.message == ""
    cli, _ = cli_for(pasted, capsys, tmp_path / "emit")
    assert json.loads(plan_json(pasted.plan)) == cli == json.loads(plan_json(uploaded.plan))
    folder = Path(shlex.split(pasted.command)[3]).parent
    as_folder = handlers.plan_page(tmp_path, *values(source="folder", folder=str(folder), seq_len=1024))
    assert as_folder.message == "" and as_folder.plan["recommended"]["time"] == cli["recommended"]["time"]


BAD = {
    "unknown preset": (dict(preset="llama-9-999b"), "error: model 'llama-9-999b': not a preset"),
    "malformed config.json": (dict(source="config.json", config_text="{\"hidden_size\": 4096,"),
                              "error: config.json: malformed JSON at line 1"),
    "config.json not an object": (dict(source="config.json", config_text="[1, 2]"),
                                  "error: config.json: expected a JSON object"),
    "config.json missing fields": (dict(source="config.json", config_text="{\"model_type\": \"llama\"}"),
                                   "error: "),
    "no config given": (dict(source="config.json"), "error: config.json: paste"),
    "folder without config": (dict(source="folder", folder="/nonexistent/model"), "error: model "),
    "0 GPUs": (dict(count=0), "error: GPUs per node 0: must be a whole number of at least 1"),
    "0 nodes": (dict(nodes=0), "error: nodes 0: must be a whole number"),
    "sequence length 0": (dict(seq_len=0), "error: sequence length 0: must be a whole number of at least 1"),
    "blank sequence length": (dict(seq_len=None), "error: sequence length: give a whole number"),
    "half a micro-batch": (dict(micro_batch=1.5), "error: micro-batch 1.5"),
    "margin 1": (dict(margin=1), "error: margin 1: a fraction from 0 to below 1"),
    "no method": (dict(methods=[]), "error: methods: tick at least one"),
    "negative CPU RAM": (dict(cpu_ram_gb=-4), "error: CPU RAM -4: must be more than 0 GB"),
    "no GPU kind": (dict(gpu=""), "error: GPU: pick a GPU kind"),
    "negative SP degree": (dict(sequence_parallel=-1), "error: sequence parallel degree (0: the planner's choice) "
                           "-1: must be a whole number of at least 0"),
    "unknown offload": (dict(activation_offload="some"), "error: activation offload 'some': one of planner's "
                        "choice, none, checkpointed, all"),
    "learned positions past their table": (dict(preset="santacoder", seq_len=4096),
                                           "error: no combination can run here: strategy.seq_len=4096 is above "
                                           "santacoder's n_positions=2048"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gives_one_inline_line(case, tmp_path):
    kw, start = BAD[case]
    out = handlers.plan_page(tmp_path, *values(**kw))
    assert out.message.startswith(start), out.message
    assert "\n" not in out.message and "Traceback" not in out.message and "internal error" not in out.message
    assert out.plan is None and out.files == [] and out.text == ""
    assert list(out.bars.columns) == ["plan", "component", "GB", "note"] and out.bars.empty


def test_unreadable_upload_and_unexpected_failure_are_one_line(tmp_path, monkeypatch):
    binary = tmp_path / "config.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    out = handlers.plan_page(tmp_path, *values(source="config.json", config_file=str(binary)))
    assert out.message == "error: config.json: the uploaded file cannot be read as UTF-8 text"
    from memfit.ui import compute

    monkeypatch.setattr(compute, "run_plan", lambda *a: 1 / 0)
    out = handlers.plan_page(tmp_path, *values())
    assert out.message == "error: internal error (ZeroDivisionError: division by zero)"


def test_custom_memory_plans_without_downloads(tmp_path):
    out = handlers.plan_page(tmp_path, *values(count=2, seq_len=2048, custom_gb=48))
    assert out.message == ""
    assert out.plan["recommended"]["hardware"]["gpu_memory_bytes"] == 48_000_000_000
    assert out.files == [] and "custom memory size has no `memfit plan` flag" in out.command


def test_nothing_fits_shows_why_and_no_downloads(tmp_path, capsys):
    out = handlers.plan_page(tmp_path, *values(preset="llama-2-70b", gpu="T4-16GB", count=1, seq_len=4096,
                                               methods=["full"]))
    assert out.message == "" and out.plan["recommended"] is None and out.files == []
    assert out.headline == "Nothing fits." and "Nothing fits" in out.text
    assert "--emit" not in out.command
    code, stdout, _ = run_cli(capsys, *shlex.split(out.command)[1:], "--json")
    assert code == 0 and json.loads(stdout) == json.loads(plan_json(out.plan))


def test_matrix_and_gpu_count_tables_equal_the_cli(tmp_path, capsys):
    msg, table = handlers.matrix_page(*values(count=2))
    assert msg == ""
    code, stdout, _ = run_cli(capsys, "matrix", "--gpus", "2xRTX4090-24GB", "--json")
    assert code == 0
    cells = {(c["model"], str(c["seq_len"])): c["label"] for c in json.loads(stdout)["cells"]}
    assert {(row["model"], s): row[s] for _, row in table.iterrows() for s in table.columns[1:]} == cells
    msg, counts = handlers.count_page(tmp_path, 3, 2.5, 10**8, *values(seq_len=1024))
    assert msg == ""
    code, stdout, _ = run_cli(capsys, "plan", "--model", "llama-2-7b", "--gpu", "RTX4090-24GB", "--max-gpus", "3",
                              "--seq-len", "1024", "--gpu-hour-price", "2.5", "--tokens", str(10**8), "--json")
    rows = json.loads(stdout)["rows"]
    assert list(counts["GPUs"]) == [r["gpus"] for r in rows]
    assert list(counts["s/step"]) == [round(r["step_seconds"], 4) for r in rows]
    assert list(counts["cost"]) == [round(r["cost"], 2) for r in rows]
    assert counts["GPUs"][counts["best"] == "▶"].tolist() == [json.loads(stdout)["best_gpus"]]
    assert handlers.count_page(tmp_path, 0, None, None, *values())[0].startswith("error: largest GPU count 0")
    coder = handlers.count_page(tmp_path, 2, None, None, *values(preset="santacoder", seq_len=4096))[0]
    assert coder.startswith("error: strategy.seq_len=4096 is above santacoder's n_positions=2048")


def make_run(folder: Path) -> Path:
    """A finished run folder in the schema of a real one (tests/train/test_report.py's)."""
    from tests.train.test_report import _metrics, _summary

    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps(_summary(folder), indent=2))
    (folder / "metrics.jsonl").write_text(_metrics())
    return folder


def test_runs_are_listed_and_their_reports_shown(tmp_path):
    pytest.importorskip("matplotlib")
    run = make_run(tmp_path / "runs" / "demo-lora")
    (tmp_path / "runs" / "unfinished").mkdir()
    msg, table, choices = handlers.runs_page(str(tmp_path / "runs"))
    assert msg == "" and choices == [str(run)]
    assert table.iloc[0]["strategy"] == "lora+ddp+sdpa" and table.iloc[0]["report.html"] == "not yet"
    note, frame = handlers.report_page(str(run))
    assert note.startswith(f"report: {run / 'report.html'} (drawn now") and (run / "report.html").is_file()
    assert frame.startswith('<iframe id="memfit-report-frame"') and "&lt;svg" in frame
    assert "&lt;script&gt;alert" not in frame.replace("&amp;lt;script&amp;gt;", "")  # the run's text escaped
    assert handlers.report_page(str(tmp_path / "runs" / "unfinished"))[0].startswith("error: ")
    assert handlers.runs_page(str(tmp_path / "nowhere"))[0].startswith("error: runs folder")
    assert handlers.runs_page(str(tmp_path / "runs" / "unfinished"))[0].startswith("no run folders")


def test_the_page_imports_neither_torch_nor_gradio_to_plan(tmp_path):
    code = ("import sys; from memfit.ui import handlers, page; "
            f"o = handlers.plan_page({str(tmp_path)!r}, 'preset', 'llama-2-7b', '', '', None, 'RTX4090-24GB', 2, 1,"
            f" None, None, 2048, 1, 1, {list(PLANNED)!r}, 0.05); assert o.message == '', o.message; "
            "print(sorted(m for m in ('torch', 'gradio', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_missing_gradio_is_one_line(capsys, monkeypatch):
    from memfit.cli import extras

    monkeypatch.setattr(extras, "installed", lambda m: m != "gradio")
    code, out, err = run_cli(capsys, "ui", "--port", "7999")
    assert code == 2 and out == ""
    assert err.strip() == "error: memfit ui needs the ui extra: pip install 'memfit[ui]'"
