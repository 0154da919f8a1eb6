"""`memfit report RUN_DIR`: one self-contained report.html per run folder, and `memfit train` writing it.

The folder is hand-written in the schema of a real run (`memfit demo`'s summary.json and metrics.jsonl,
trimmed), so the report's tests take milliseconds; two tiny real training runs check that `memfit train`
writes the report, and that a missing `[plot]` extra or a failing report never fails the run.
"""

from __future__ import annotations

import json
import os
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from cli_helper import run_cli  # noqa: E402
from memfit.cli import extras  # noqa: E402
from memfit.train import report as report_mod  # noqa: E402

LOSSES = [(1, 6.1883463859558105), (2, 6.210341930389404), (3, 5.977868556976318), (4, 5.843280792236328)]
EVAL = 4.6594929695129395
GPU_BYTES = {"weights": 4019712, "gradients": 591872, "optimizer": 1183744, "activations": 37289984,
             "logits": 6279168, "lora_intermediates": 1835008, "meft_buffers": 0, "gathered_params": 0,
             "comm_buffers": 0, "step_temporaries": 369920, "peak_concurrency": -961792,
             "overhead": 65512648, "total": 116120264}
HOSTILE = '<script>alert("x")</script> & <img src=x onerror=1>'


def _summary(out: Path) -> dict:
    strategy = {"method": "lora", "zero_stage": 0, "fsdp": False, "fsdp_version": 2, "offload": "none",
                "gradient_checkpointing": False, "attention": "sdpa", "optimizer": "adamw",
                "precision": "fp32", "micro_batch_size": 8, "grad_accum": 1, "seq_len": 128,
                "loss": "standard", "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.0}
    return {
        "output_dir": str(out), "saved_to": str(out / "adapter"), "method": "lora", "steps": 4,
        "first_loss": LOSSES[0][1], "final_loss": LOSSES[-1][1], "eval_loss": EVAL,
        "losses": [list(x) for x in LOSSES], "step_time_s": 0.09837137300019094,
        "tokens_per_s": 5572.938390932175, "train_tokens": 27701, "peak_mem_bytes": 644280320,
        "peak_mem_kind": "peak_rss", "train_runtime_s": 4.326, "resumed_from": None,
        "metrics_file": str(out / "metrics.jsonl"),
        "data": {"source": "d.jsonl", "format": "dialogue_summary", "examples": 400, "train_examples": 380,
                 "eval_examples": 20, "truncated": 0, "tokens_cut": 0, "dropped": 0},
        "model": {"path": "/m/tiny-llama", "method": "lora", "dtype": "float32", "attention": "sdpa",
                  "device": "cpu", "params": 1004928, "trainable": 147968},
        "predicted": {
            "hardware": {"gpu": "CPU", "gpus_per_node": 1, "nodes": 1, "gpu_memory_bytes": 25275990016,
                         "cpu_ram_bytes": 25275990016},
            "strategy": strategy,
            "memory": {"gpu_bytes": GPU_BYTES, "gpu_line_kinds": {k: "formula" for k in GPU_BYTES},
                       "gpu_allocated_bytes": 50607616, "gpu_reserved_bytes": 116120264,
                       "held_against_capacity": "gpu_bytes.total = reserved + CUDA context + NCCL buffers",
                       "usable_gpu_bytes": 24012190515, "margin": 0.05,
                       "cpu_bytes": {"process_baseline": 600000000, "total": 600000000}},
            "time": {"step_seconds": 0.17242363868994512, "tokens_per_second": 5938.860864903639,
                     "basis": "measured on this machine 2026-12-02"},
            "fits": True, "reasons": [],
        },
        "predicted_step": {"step_seconds": 0.1171363833656732, "shape": "padded",
                           "basis": "at the data's padded lengths (median 86, max 86 of planned 128)",
                           "planned_step_seconds": 0.17242363868994512, "planned_shape": "8 × 128",
                           "memory_basis": "at the planned shape 8 × 128"},
        "notes": [HOSTILE],
    }


def _metrics() -> str:
    lines = []
    for step, loss in LOSSES:
        lines.append({"step": step, "time": 1796176675.0 + step, "loss": loss, "grad_norm": 2.0,
                      "learning_rate": 0.0015 * (step - 1), "epoch": step / 48, "num_input_tokens_seen": 560 * step,
                      "tokens_per_s": 5000.0 + step, "step_time_s": 0.09 + step / 1000, "step_cpu_s": 0.09,
                      "padded_tokens": 688, "padded_len": 86, "peak_mem_bytes": 644141056,
                      "peak_mem_kind": "peak_rss"})
    ev = {"step": 4, "time": 1796176680.0, "eval_loss": EVAL, "eval_runtime": 0.1, "epoch": 0.08,
          "step_time_s": 0.094, "peak_mem_bytes": 644280320, "peak_mem_kind": "peak_rss"}
    end = {"step": 4, "time": 1796176680.0, "train_runtime": 4.3, "train_loss": 5.1, "step_time_s": 0.094}
    return "".join(json.dumps(x) + "\n" for x in [*lines, ev, end, ev])  # the eval line twice, as a real run


@pytest.fixture
def run_dir(tmp_path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    (d / "summary.json").write_text(json.dumps(_summary(d), indent=2))
    (d / "metrics.jsonl").write_text(_metrics())
    (d / "run.yaml").write_text("model: /m/tiny-llama\n")
    return d


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.is_dir(), p.stat().st_size if p.is_file() else 0, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


class _Checker(HTMLParser):
    """Tags balanced (void elements aside), no external references."""

    VOID = {"meta", "br", "img", "hr", "input", "link"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.tags: set[str] = set()
        self.refs: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.refs += [v for k, v in attrs if k in ("src", "href", "xlink:href") and v and not v.startswith("#")]
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.add(tag)
        self.refs += [v for k, v in attrs if k in ("src", "href", "xlink:href") and v and not v.startswith("#")]

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, (tag, self.stack[-5:])
        self.stack.pop()


def _check_html(text: str) -> _Checker:
    p = _Checker()
    p.feed(text)
    p.close()
    assert p.stack == [], p.stack
    assert p.refs == []
    assert "script" not in p.tags and "link" not in p.tags and "iframe" not in p.tags
    for bad in ("http://", "https://", "@import", "<script"):
        assert bad not in text, bad
    assert all(u.startswith("#") for u in re.findall(r"url\(\s*['\"]?([^)'\"]*)", text))  # clip paths only
    return p


# ------------------------------------------------------------------ the report
def test_report_holds_the_numbers_and_opens_offline(run_dir, capsys):
    before = set(os.listdir(run_dir))
    code, out, err = run_cli(capsys, "report", str(run_dir))
    assert code == 0, err
    page = run_dir / "report.html"
    assert set(os.listdir(run_dir)) == before | {"report.html"}  # nothing else (no temporary left)
    assert out.rstrip().endswith(f"report: {page}")
    assert "lora+ddp+sdpa" in out and "6.1883 → 5.8433" in out and "+1.0%" in out
    text = page.read_text()
    p = _check_html(text)
    assert "svg" in p.tags and text.count("<svg") == 4  # loss, learning rate, step time/tokens/s, memory
    for _, loss in LOSSES:  # the loss values (metrics by step) and the eval loss
        assert f"{loss:.6g}" in text
    assert f"{EVAL:.6g}" in text and "6.1883 → 5.8433" in text
    for name in ("weights", "activations", "logits", "lora_intermediates", "overhead", "peak_concurrency"):
        assert f"<td>{name}</td>" in text
    assert "meft_buffers" not in text  # a zero component is left out
    for figure in ("37.29 MB", "65.51 MB", "116.12 MB", "50.61 MB", "650.61 MB", "644.28 MB", "+1.0 %"):
        assert figure in text
    assert "117.1 ms" in text and "172.4 ms" in text and "98.4 ms" in text  # step time, predicted vs measured
    assert "lora+ddp+sdpa" in text and "<td>CPU</td>" in text and "<td>fp32</td>" in text  # strategy, hardware
    assert "The estimator says this strategy fits" in text and "measured on this machine" in text  # reasons
    assert "<script>alert" not in text and "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in text


def test_json_prints_paths_and_numbers(run_dir, capsys, tmp_path):
    page = tmp_path / "elsewhere" / "r.html"
    before = _snapshot(run_dir)
    code, out, err = run_cli(capsys, "report", str(run_dir), "--out", str(page), "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["report_file"] == str(page) and page.is_file()
    assert _snapshot(run_dir) == before  # --out: the run folder untouched
    assert d["strategy"] == "lora+ddp+sdpa" and d["steps"] == 4
    assert d["series"]["loss"] == [[s, v] for s, v in LOSSES]
    assert d["series"]["eval_loss"] == [[4, EVAL]]  # one value per step, the duplicate line merged
    assert [x[0] for x in d["series"]["step_time_s"]] == [1, 2, 3, 4]
    mem = {m["component"]: m for m in d["memory"]}
    assert mem["activations"]["predicted_bytes"] == GPU_BYTES["activations"]
    assert mem["tensors + process (peak RSS)"]["measured_bytes"] == 644280320
    assert d["step_time"]["predicted_step_s"] == pytest.approx(0.1171363833656732)
    _check_html(page.read_text())


def test_gpu_run_compares_allocated(run_dir, capsys):
    s = json.loads((run_dir / "summary.json").read_text())
    s.update(peak_mem_kind="cuda_max_allocated", peak_mem_bytes=52000000, predicted_step=None, notes=[])
    (run_dir / "summary.json").write_text(json.dumps(s))
    r = report_mod.write_report(run_dir)
    mem = {m["component"]: m for m in r.memory}
    assert mem["allocated (tensors)"]["measured_bytes"] == 52000000
    assert mem["allocated (tensors)"]["error_pct"] == pytest.approx(-2.7, abs=0.05)
    assert "tensors + process (peak RSS)" not in mem


# ------------------------------------------------------------------ bad input: one line, folder unchanged
def _bad_cases(tmp: Path, good: Path):
    def variant(name, summary=True, metrics=True, **files):
        d = tmp / name
        d.mkdir()
        if summary:
            (d / "summary.json").write_text((good / "summary.json").read_text())
        if metrics:
            (d / "metrics.jsonl").write_text((good / "metrics.jsonl").read_text())
        for fname, content in files.items():
            path = d / fname.replace("_", ".")
            if isinstance(content, bytes):
                path.write_bytes(content)
            elif content is None:
                path.mkdir()
            else:
                path.write_text(content)
        return d

    hint = "give the output_dir of a `memfit train` run (e.g. runs/demo)"
    missing = tmp / "missing"
    a_file = tmp / "a-file"
    a_file.write_text("keep me\n")
    empty = variant("empty", summary=False, metrics=False)
    unfinished = variant("unfinished", summary=False)
    no_metrics = variant("no-metrics", metrics=False)
    lines = _metrics().splitlines()
    corrupt = variant("corrupt", metrics=False, metrics_jsonl="\n".join([*lines[:2], '{"step": 3, "loss": 5.9',
                                                                        *lines[3:]]) + "\n")
    listed = variant("listed", metrics=False, metrics_jsonl=lines[0] + "\n[1, 2]\n")
    stepless = variant("stepless", metrics=False, metrics_jsonl=lines[0] + '\n\n{"loss": 2.0}\n')
    bad_summary = variant("bad-summary", summary=False, summary_json='{"steps": 4,\n "method": ')
    not_summary = variant("not-summary", summary=False, summary_json='{"hello": 1}')
    binary = variant("binary", metrics=False, metrics_jsonl=b'{"step": 1}\n\xff\xfe\x00garbage\n')
    folder = variant("folder", metrics=False, metrics_jsonl=None)
    return [
        (missing, f"{missing}: no such folder; {hint}"),
        (a_file, f"{a_file} is a file, not a folder; {hint}"),
        (empty, f"{empty} is not a memfit run folder: no summary.json or metrics.jsonl; {hint}"),
        (unfinished, f"{unfinished} holds no summary.json: the run has not finished (interrupted or still "
                     f"running); resume it with `memfit train {unfinished / 'run.yaml'} --resume`, then report"),
        (no_metrics, f"{no_metrics} holds no metrics.jsonl beside summary.json; the report draws the run's "
                     "logs from it"),
        (corrupt, f"{corrupt / 'metrics.jsonl'}:3: not a JSON line; the file is damaged (fix or delete line 3)"),
        (listed, f"{listed / 'metrics.jsonl'}:2: a JSON object expected, got list"),
        (stepless, f"{stepless / 'metrics.jsonl'}:3: no step number (each line needs \"step\": N)"),
        (bad_summary, f"{bad_summary / 'summary.json'}: not valid JSON, line 2; the file is damaged (a new run "
                      "writes it again)"),
        (not_summary, f"{not_summary / 'summary.json'}: not a memfit run summary (a JSON object with steps, "
                      "method, ...)"),
        (binary, f"cannot read {binary / 'metrics.jsonl'}: not UTF-8 text (byte 12); the file is damaged"),
        (folder, f"cannot read {folder / 'metrics.jsonl'}: it is a folder, not a file"),
    ]


def test_bad_inputs_are_one_line_and_leave_the_folder(run_dir, tmp_path, capsys):
    (tmp_path / "bad").mkdir()
    cases = _bad_cases(tmp_path / "bad", run_dir)
    for path, line in cases:
        before = _snapshot(tmp_path)
        code, out, err = run_cli(capsys, "report", str(path))
        assert (code, out, err) == (2, "", f"error: {line}\n"), path
        assert _snapshot(tmp_path) == before, path


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files without permission")
def test_unreadable_file(run_dir, capsys):
    (run_dir / "metrics.jsonl").chmod(0)
    before = _snapshot(run_dir)
    code, out, err = run_cli(capsys, "report", str(run_dir))
    assert (code, out) == (2, "")
    assert err == f"error: cannot read {run_dir / 'metrics.jsonl'}: permission denied\n"
    assert _snapshot(run_dir) == before


def test_write_failure_is_one_line(run_dir, tmp_path, capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a folder belongs\n")
    before = _snapshot(tmp_path)
    code, out, err = run_cli(capsys, "report", str(run_dir), "--out", str(blocker / "r.html"))
    assert (code, out) == (2, "")
    assert err.startswith("error: cannot write") and err.count("\n") == 1
    assert _snapshot(tmp_path) == before


def test_a_failure_while_drawing_leaves_no_file(run_dir, monkeypatch):
    def boom(r, figs=None):
        raise RuntimeError("drawing failed")

    monkeypatch.setattr(report_mod, "render_html", boom)
    before = _snapshot(run_dir)
    with pytest.raises(RuntimeError):
        report_mod.write_report(run_dir)
    assert _snapshot(run_dir) == before


def test_missing_plot_extra_is_one_line(run_dir, capsys, monkeypatch):
    real = extras.installed
    monkeypatch.setattr(extras, "installed", lambda m: m != "matplotlib" and real(m))
    before = _snapshot(run_dir)
    code, out, err = run_cli(capsys, "report", str(run_dir))
    assert (code, out) == (2, "")
    assert err == "error: memfit report needs the plot extra: pip install 'memfit[plot]'\n"
    assert _snapshot(run_dir) == before


# ------------------------------------------------------------------ memfit train writes it
@pytest.fixture(scope="module")
def tiny_run_file(tmp_path_factory, tiny_model_dir):
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    from memfit.spec.run import run_from_dict
    from memfit.train.demo import make_dialogue_records, write_jsonl

    root = tmp_path_factory.mktemp("report-train")
    recs = make_dialogue_records(24, seed=3)
    model = tiny_model_dir("report", [r["dialogue"] + "\n" + r["summary"] for r in recs])
    data = write_jsonl(recs, root / "d.jsonl")

    def make(out: Path):
        return run_from_dict({"model": str(model), "data": {"path": str(data), "eval_fraction": 0.1},
                              "strategy": {"precision": "fp32", "seq_len": 64, "micro_batch_size": 2,
                                           "lora_dropout": 0.0},
                              "training": {"max_steps": 3, "learning_rate": 1e-2},
                              "output_dir": str(out)})
    make.paths = (model, data)
    return make


def test_train_writes_the_report_and_prints_its_path(tiny_run_file, tmp_path, capsys):
    from memfit.spec.run import save_run

    out = tmp_path / "out"
    path = save_run(tiny_run_file(out), tmp_path / "run.yaml")
    code, stdout, err = run_cli(capsys, "train", str(path))
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["report"] == str(out / "report.html")
    assert f"report: {out / 'report.html'}" in stdout
    text = (out / "report.html").read_text()
    _check_html(text)
    for _, loss in summary["losses"]:
        assert f"{loss:.6g}" in text


@pytest.mark.parametrize("broken", ["no-plot", "drawing-fails"])
def test_a_report_problem_never_fails_the_run(tiny_run_file, tmp_path, monkeypatch, broken):
    from memfit.train.api import train

    out = tmp_path / "out"
    if broken == "no-plot":
        monkeypatch.setattr(report_mod, "plot_available", lambda: False)
        note = (f"no report.html: matplotlib is not installed; pip install 'memfit[plot]', then "
                f"`memfit report {out}`")
    else:
        def boom(r, figs=None):
            raise RuntimeError("drawing\nfailed")

        monkeypatch.setattr(report_mod, "render_html", boom)
        note = f"report.html not written (drawing failed); try again with `memfit report {out}`"
    result = train(tiny_run_file(out))
    assert result.steps == 3 and result.report is None
    assert result.notes[-1] == note
    summary = json.loads((out / "summary.json").read_text())
    assert summary["notes"][-1] == note and summary["report"] is None
    assert not (out / "report.html").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".report")]


def test_auto_keeps_the_planners_reasons(tiny_run_file, tmp_path, capsys):
    import html

    model, data = tiny_run_file.paths
    out = tmp_path / "auto"
    code, stdout, err = run_cli(capsys, "train", "--auto", "--model", str(model), "--data", str(data),
                                "--out", str(out), "--seq-len", "64", "--micro-batch-size", "2",
                                "--methods", "lora", "--set", "max_steps=2", "--json")
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    why = summary["plan_why"]
    assert why and "is the fastest of the" in why[0]
    text = (out / "report.html").read_text()
    assert f"<li>{html.escape(why[0])}</li>" in text
