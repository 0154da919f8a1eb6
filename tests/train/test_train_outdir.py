"""Never lose or mix results: finished runs, --overwrite, --resume of a finished run, Ctrl-C, a full
disk, file permissions; and the data checks that keep a run from training on nothing."""

import errno
import json
import os
import stat
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
from transformers import TrainerCallback  # noqa: E402

from memfit.errors import MemfitError, TrainingInterrupted  # noqa: E402
from memfit.io import WriteError  # noqa: E402
from memfit.spec.run import run_from_dict  # noqa: E402
from memfit.train.api import train  # noqa: E402
from memfit.train.demo import TinyModelConfig, build_tiny_model, make_dialogue_records, write_jsonl  # noqa: E402

MICRO = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, vocab_size=300, max_position_embeddings=128)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("outdir")
    recs = make_dialogue_records(32, seed=4)
    model = build_tiny_model(root / "model", MICRO, texts=[r["dialogue"] + "\n" + r["summary"] for r in recs])
    return model, write_jsonl(recs, root / "d.jsonl")


def make_run(assets, out, steps=2, **training):
    model, data = assets
    return run_from_dict({"model": str(model), "data": {"path": str(data), "eval_fraction": 0.0},
                          "strategy": {"precision": "fp32", "seq_len": 128, "micro_batch_size": 2, "lora_r": 4},
                          "training": {"max_steps": steps, "learning_rate": 1e-2, **training},
                          "output_dir": str(out)})


def _adapter(out: Path) -> bytes:
    return (out / "adapter" / "adapter_model.safetensors").read_bytes()


def test_finished_run_is_kept_resumed_to_nothing_or_overwritten(assets, tmp_path):
    out = tmp_path / "run"
    old = os.umask(0o022)
    try:
        first = train(make_run(assets, out, checkpoint_interval=1))
    finally:
        os.umask(old)
    assert first.steps == 2
    # every result file has the usual permissions (not mkstemp's 0600 / 0700)
    for p in (out / "summary.json", out / "run.yaml", out / "metrics.jsonl",
              out / "adapter" / "adapter_model.safetensors"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, p
    assert stat.S_IMODE((out / "adapter").stat().st_mode) == 0o755
    adapter = _adapter(out)
    with pytest.raises(MemfitError, match="holds a finished run .*--overwrite to replace it"):
        train(make_run(assets, out))
    again = train(make_run(assets, out), resume=True)  # a finished run resumes to nothing
    assert again.steps == 2 and "already finished at step 2" in again.notes[-1]
    assert _adapter(out) == adapter
    # more steps than it ran: resume continues from its last checkpoint
    longer = train(make_run(assets, out, steps=3, checkpoint_interval=1), resume=True)
    assert longer.steps == 3 and longer.resumed_from.endswith("checkpoint-2")
    # --overwrite: the earlier run's files are gone before the new one writes
    fresh = train(make_run(assets, out, steps=1, seed=7), overwrite=True)
    assert fresh.steps == 1 and not list(out.glob("checkpoint-*"))
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert steps == [1]


class _Interrupt(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if state.global_step == 2:
            raise KeyboardInterrupt


def test_ctrl_c_says_step_checkpoint_and_how_to_resume(assets, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    with pytest.raises(TrainingInterrupted) as err:
        train(make_run(assets, out, steps=4, checkpoint_interval=1), callbacks=[_Interrupt()])
    assert str(err.value) == (f"interrupted at step 2; last checkpoint {out / 'checkpoint-1'}; resume with "
                              f"`memfit train {out / 'run.yaml'} --resume`")
    # the CLI: that line alone, exit 130, and the progress bar closed (the cursor comes back)
    from memfit.cli.app import main
    from memfit.spec.run import save_run
    from memfit.train import api
    from memfit.train.callbacks import RichProgress

    closed = []
    monkeypatch.setattr(RichProgress, "close", lambda self: closed.append(True))
    monkeypatch.setattr(api, "_train", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    path = save_run(make_run(assets, tmp_path / "cli"), tmp_path / "run.yaml")
    capsys.readouterr()
    with pytest.raises(SystemExit) as code:
        main(["train", str(path)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code.value.code == 130 and closed == [True]
    assert lines == ["interrupted at step 0; no checkpoint was written (training.checkpoint_interval=0); "
                     "start again with --overwrite"]


def test_disk_full_during_a_checkpoint_keeps_the_last_one(assets, tmp_path, monkeypatch):
    from memfit.train import trainer as T

    real = T.Trainer._save_checkpoint
    calls = []

    def full(self, model, trial):
        calls.append(1)
        if len(calls) == 2:
            staged = Path(self._get_output_dir(trial)) / "checkpoint-2"
            staged.mkdir(parents=True)
            (staged / "optimizer.pt").write_bytes(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, model, trial)

    monkeypatch.setattr(T.Trainer, "_save_checkpoint", full)
    out = tmp_path / "run"
    with pytest.raises(WriteError) as err:
        train(make_run(assets, out, steps=3, checkpoint_interval=1))
    assert str(err.value) == (f"cannot write checkpoint checkpoint-2 in {out}: no space left on device; the "
                              f"last checkpoint {out / 'checkpoint-1'} is kept (free space, then continue "
                              "with --resume)")
    assert sorted(p.name for p in out.iterdir() if p.name.startswith((".", "checkpoint"))) == ["checkpoint-1"]


def test_disk_full_during_the_final_save_names_what_was_kept(assets, tmp_path, monkeypatch):
    from memfit.io import write_error
    from memfit.train import api

    def full(*a, **k):
        raise write_error(OSError(errno.ENOSPC, "No space"), tmp_path / "run" / "adapter")

    monkeypatch.setattr(api, "save_outputs", full)
    with pytest.raises(WriteError, match=r"no space left on device; the trained weights of step 2 were not "
                                         r"saved; the last checkpoint .*checkpoint-2 is kept"):
        train(make_run(assets, tmp_path / "run", checkpoint_interval=1))


# ------------------------------------------------------------------ data that would train on nothing
def _records(tmp_path, rows):
    return write_jsonl(rows, tmp_path / "d.jsonl")


def test_empty_records_are_skipped_and_counted(assets, tmp_path):
    from memfit.train.data import prepare_datasets
    from memfit.train.model import load_tokenizer

    tok = load_tokenizer(assets[0])
    rows = [{"prompt": "", "completion": ""}, {"prompt": "Hi", "completion": " there"},
            {"prompt": " ", "completion": " "}]
    run = make_run((assets[0], _records(tmp_path, rows)), tmp_path / "o")
    train_ds, _, rep = prepare_datasets(run, tok, vocab_size=len(tok))
    assert rep.extra["empty"] == 2 and rep.train_examples == 1 and len(train_ds) == 1


def test_a_tokenizer_that_is_not_the_models_is_refused(assets, tmp_path):
    from memfit.errors import ConfigError
    from memfit.train.data import check_tokenizer
    from memfit.train.model import load_tokenizer

    tok = load_tokenizer(assets[0])
    texts = ["a summary of a dialogue about a meeting at the station tomorrow"] * 8
    check_tokenizer(tok, len(tok), texts, "m")  # its own model: fine
    with pytest.raises(ConfigError, match=rf"the tokenizer has {len(tok)} tokens but the model's vocabulary "
                                          r"has 32000; it is not this model's tokenizer"):
        check_tokenizer(tok, 32000, texts, "m")

    class Empty:  # what transformers builds for a folder without tokenizer files: text -> no tokens
        def __len__(self):
            return 300

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": []}

    with pytest.raises(ConfigError, match=r"turns \d+ characters of sample records into 0 tokens"):
        check_tokenizer(Empty(), 300, texts, "m")
