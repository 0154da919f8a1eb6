"""A command that needs a missing pip extra prints one line naming it (exit 2), before importing anything.

The missing extra is simulated by making memfit.cli.extras.installed report the extra's modules absent;
a fresh venv with `pip install memfit` (no extras) prints the same lines (README, Install).
"""

import pytest

from memfit.cli import extras
from memfit.spec.run import run_from_dict
from cli_helper import run_cli


def _without(monkeypatch, *modules):
    real = extras.installed
    monkeypatch.setattr(extras, "installed", lambda m: m not in modules and real(m))


_cli = run_cli


def _run_file(tmp_path, **strategy):
    path = tmp_path / "run.yaml"
    lines = ["model: llama-2-7b", "hardware: local", f"output_dir: {tmp_path / 'out'}", "strategy:"]
    lines += [f"  {k}: {v}" for k, v in strategy.items()] or ["  method: lora"]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


TRAIN_LINE = "error: memfit {} needs the training extra: pip install 'memfit[train]'"


@pytest.mark.parametrize("argv, command", [
    (["demo"], "demo"),
    (["train", "x.yaml"], "train"),  # before the run file is read: the extra is the first thing missing
    (["measure", "--model", "x", "--method", "lora"], "measure"),
])
def test_missing_torch_is_one_line_naming_the_extra(capsys, monkeypatch, argv, command):
    _without(monkeypatch, "torch")
    code, out, err = _cli(capsys, *argv)
    assert code == 2 and out == ""
    assert err == TRAIN_LINE.format(command) + "\n"


def test_launch_needs_train_but_dry_run_does_not(capsys, monkeypatch, tmp_path):
    _without(monkeypatch, "transformers")
    path = _run_file(tmp_path)
    code, out, err = _cli(capsys, "launch", path)
    assert (code, out, err) == (2, "", TRAIN_LINE.format("launch") + "\n")
    code, out, err = _cli(capsys, "launch", path, "--dry-run", "--json")
    assert code == 0 and '"command"' in out


def test_matrix_png_needs_plot(capsys, monkeypatch, tmp_path):
    _without(monkeypatch, "matplotlib")
    code, out, err = _cli(capsys, "matrix", "--gpus", "1xA100-80GB", "--png", str(tmp_path / "m.png"))
    assert (code, out) == (2, "")
    assert err == "error: memfit matrix --png needs the plot extra: pip install 'memfit[plot]'\n"
    assert not (tmp_path / "m.png").exists()


def test_zero_stage_needs_deepspeed(capsys, monkeypatch, tmp_path):
    _without(monkeypatch, "deepspeed")
    code, out, err = _cli(capsys, "train", _run_file(tmp_path, method="full", zero_stage=2))
    assert (code, out) == (2, "")
    assert err == "error: memfit train needs the deepspeed extra: pip install 'memfit[deepspeed]'\n"


def test_extras_for_run():
    def run(**s):
        return run_from_dict({"model": "llama-2-7b", "hardware": "local", "strategy": s})

    assert extras.extras_for_run(run(method="lora")) == ["train"]
    assert extras.extras_for_run(run(method="full", zero_stage=3)) == ["train", "deepspeed"]
    assert extras.extras_for_run(run(method="qlora")) == ["train", "qlora"]


def test_installed_reads_the_path():
    assert extras.installed("json") and not extras.installed("no_such_module_memfit")
