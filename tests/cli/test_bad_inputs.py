"""Malformed and hostile inputs across plan / estimate / train / measure / demo.

Every case must end the same way: exit status 2, exactly one ``error: ...`` line on stderr, no
traceback, and the folders a user already had (a finished run, the file in the way) unchanged. The CLI
runs in this process (``memfit.cli.app.main``), so each refusal costs milliseconds to a model load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from memfit.cli.app import main  # noqa: E402
from memfit.spec.run import run_from_dict, save_run  # noqa: E402
from memfit.train.demo import TinyModelConfig, build_tiny_model, make_dialogue_records, write_jsonl  # noqa: E402

MICRO = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, vocab_size=300, max_position_embeddings=128)
PRESET = "llama-2-7b"
POOL = "1xA100-80GB"


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny model, good data, broken models and data, a finished run and a file in the way."""
    root = tmp_path_factory.mktemp("bad-inputs")
    old_cache = os.environ.get("MEMFIT_CACHE")
    os.environ["MEMFIT_CACHE"] = str(root / "cache")  # the demo's model, built on first use
    recs = make_dialogue_records(24, seed=1)
    model = build_tiny_model(root / "model", MICRO, texts=[r["dialogue"] + "\n" + r["summary"] for r in recs])
    w = {"root": root, "model": model, "data": write_jsonl(recs, root / "data.jsonl")}
    w.update(_broken_models(root, model))
    w.update(_broken_data(root))
    w["finished"] = _finished_run(root / "finished", model, w["data"])
    w["file"] = root / "a-file"
    w["file"].write_text("keep me\n")
    w["ckpt"] = _run_with_checkpoint(root / "ckpt", model, w["data"])
    w["unfinished"] = root / "unfinished"
    w["unfinished"].mkdir()
    (w["unfinished"] / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    yield w
    if old_cache is None:
        os.environ.pop("MEMFIT_CACHE", None)
    else:
        os.environ["MEMFIT_CACHE"] = old_cache


def _copy_model(src: Path, dst: Path, skip=()) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in skip:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _broken_models(root: Path, good: Path) -> dict:
    out = {}
    cfg = json.loads((good / "config.json").read_text())
    for name, text in [("cfg_not_json", b"{ not json"), ("cfg_list", b"[1, 2]"),
                       ("cfg_binary", bytes(range(256)) * 4),
                       ("cfg_string_number", json.dumps({**cfg, "hidden_size": "big"}).encode())]:
        out[name] = _copy_model(good, root / name)
        (out[name] / "config.json").write_bytes(text)
    out["corrupt_weights"] = _copy_model(good, root / "corrupt_weights")
    (out["corrupt_weights"] / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    out["empty_weights"] = _copy_model(good, root / "empty_weights")
    (out["empty_weights"] / "model.safetensors").write_bytes(b"")
    out["no_tokenizer"] = _copy_model(good, root / "no_tokenizer",
                                      skip={"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"})
    out["empty_tokenizer"] = root / "empty_tokenizer"  # transformers builds a 2-token tokenizer for it
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=400, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=128)
                       ).save_pretrained(out["empty_tokenizer"])
    out["no_config"] = root / "no_config"
    out["no_config"].mkdir()
    return out


def _broken_data(root: Path) -> dict:
    d = root / "data"
    d.mkdir()
    files = {
        "latin1": b'{"prompt": "caf\xe9", "completion": "ok"}\n',
        "chat_number": b'{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}\n',
        "chat_role": b'{"messages": [{"role": "sytem", "content": "hi"}, {"role": "assistant", "content": "x"}]}\n',
        "all_empty": b'{"prompt": "", "completion": ""}\n{"prompt": " ", "completion": ""}\n',
        "all_empty_text": b'{"text": ""}\n{"text": ""}\n',
        "not_json": b'{"prompt": "a", "completion": "b"}\n{oops\n',
        "list_line": b'[1, 2]\n',
        "missing_field": b'{"prompt": "a"}\n',
        "text_number": b'{"text": 5}\n',
        "empty": b"",
        "unknown_fields": b'{"question": "a", "answer": "b"}\n',
    }
    out = {}
    for name, data in files.items():
        out[f"data_{name}"] = d / f"{name}.jsonl"
        out[f"data_{name}"].write_bytes(data)
    out["data_txt"] = d / "notes.txt"
    out["data_txt"].write_text("hello\n")
    fake = d / "fake_dataset"
    fake.mkdir()
    (fake / "dataset_info.json").write_text("{}")
    (fake / "state.json").write_text("not a state")
    out["data_fake_dataset"] = fake
    return out


def _finished_run(out: Path, model: Path, data: Path) -> Path:
    """What a finished run leaves: run.yaml, metrics, summary, adapter (contents are what matter here)."""
    out.mkdir()
    save_run(_run(model, data, out), out / "run.yaml")
    (out / "metrics.jsonl").write_text('{"step": 2, "loss": 1.0}\n')
    (out / "summary.json").write_text(json.dumps({"steps": 2, "output_dir": str(out)}))
    (out / "adapter").mkdir()
    (out / "adapter" / "adapter_model.safetensors").write_bytes(b"weights of run A")
    return out


def _run_with_checkpoint(out: Path, model: Path, data: Path) -> Path:
    out.mkdir()
    save_run(_run(model, data, out), out / "run.yaml")
    (out / "checkpoint-2").mkdir()
    (out / "checkpoint-2" / "trainer_state.json").write_text("{}")
    return out


def _run(model, data, out, **training):
    return run_from_dict({"model": str(model), "data": {"path": str(data), "eval_fraction": 0.0},
                          "strategy": {"precision": "fp32", "seq_len": 64, "micro_batch_size": 2,
                                       "lora_r": 4},
                          "training": {"max_steps": 2, **training}, "output_dir": str(out)})


def _snapshot(*roots: Path) -> dict:
    snap = {}
    for root in roots:
        if not root.exists():
            snap[str(root)] = None
            continue
        for p in [root, *sorted(root.rglob("*"))] if root.is_dir() else [root]:
            st = p.stat()
            snap[str(p)] = (p.is_dir(), st.st_mode, None if p.is_dir() else p.read_bytes())
    return snap


def _cli(capsys, argv):
    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def _refused(capsys, world, argv, needle, *guard: Path):
    guarded = [world["finished"], world["file"], world["ckpt"], *guard]
    before = _snapshot(*guarded)
    code, _, err = _cli(capsys, argv)
    lines = err.strip().splitlines()
    assert code == 2, f"exit {code}: {err[-2000:]}"
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    assert needle in lines[0], lines[0]
    assert _snapshot(*guarded) == before, "a refusal changed an existing folder"
    return lines[0]


def _run_file(world, tmp: Path, name="run.yaml", out=None, **keys) -> Path:
    raw = _run(keys.pop("model", world["model"]), keys.pop("data", world["data"]),
               out if out is not None else world["finished"]).model_dump(mode="json")
    for dotted, value in keys.items():
        section, key = dotted.split("__")
        raw[section][key] = value
    path = tmp / name
    save_run(run_from_dict(raw), path)
    return path


# ------------------------------------------------------------------ plan / estimate
PLAN_CASES = [
    (["estimate", "--model", PRESET, "--gpus", ""], "--gpus is empty"),
    (["estimate", "--model", "no-such-preset", "--gpus", POOL], "not a preset, folder or config.json"),
    (["estimate", "--model", "{cfg_not_json}", "--gpus", POOL], "malformed JSON at line 1"),
    (["estimate", "--model", "{cfg_list}", "--gpus", POOL], "expected a JSON object"),
    (["estimate", "--model", "{cfg_binary}", "--gpus", POOL], "not a text file"),
    (["estimate", "--model", "{cfg_string_number}", "--gpus", POOL], "'hidden_size' must be a positive integer"),
    (["estimate", "--model", "{no_config}", "--gpus", POOL], "has no config.json"),
    (["estimate", "--model", PRESET, "--gpus", POOL, "--seq-len", "abc"], "Invalid value for '--seq-len'"),
    (["estimate", "--model", PRESET, "--gpus", POOL, "--seq-len", "0"], "seq_len"),
    (["estimate", "--model", PRESET, "--gpus", POOL, "--method", "bogus"], "method"),
    (["estimate", "--model", PRESET, "--gpus", POOL, "--nodes", "0"], "--nodes 0"),
    (["estimate", "--model", PRESET, "--gpus", POOL, "--profile", "{root}/no-profile.json"], "no-profile.json"),
    (["estimate", "--model", PRESET, "--gpus", "3xNOPE-1GB"], "NOPE"),
    (["plan", "--model", PRESET, "--gpus", POOL, "--bogus"], "No such option: --bogus"),
    (["plan", "--gpus", POOL], "Missing option '--model'"),
    (["plan", "--model", PRESET, "--gpus", POOL, "--gpu", "A100-80GB"], "give one"),
    (["plan", "--model", PRESET, "--gpus", POOL, "--emit", "{file}"], "not a folder"),
    (["plan", "--model", PRESET, "--gpus", POOL, "--emit", "{file}/sub"], "a file, not a folder"),
    (["plan", "--model", PRESET, "--gpus", POOL, "--emit", "/proc/memfit-emit"], "cannot write"),
    (["plan", "--model", "{cfg_binary}", "--gpus", POOL], "not a text file"),
]


@pytest.mark.parametrize("argv, needle", PLAN_CASES, ids=[" ".join(a[:1] + a[-2:]) for a, _ in PLAN_CASES])
def test_plan_and_estimate_refuse_in_one_line(world, capsys, argv, needle):
    _refused(capsys, world, [a.format(**world) for a in argv], needle)


# ------------------------------------------------------------------ train: run file and flags
def _yaml(tmp: Path, text: str) -> Path:
    p = tmp / f"run{len(list(tmp.glob('run*.yaml')))}.yaml"
    p.write_text(text)
    return p


def test_run_file_mistakes(world, capsys, tmp_path):
    good = _run_file(world, tmp_path, "good.yaml", out=world["finished"])
    cases = [
        (["train", tmp_path / "nope.yaml"], "not found"),
        (["train", _yaml(tmp_path, "model: x\nstrategy: [a\n  b: c\n")],
         "run0.yaml:3:4: not valid YAML: expected ',' or ']'"),
        (["train", _yaml(tmp_path, "model: x\ntraining:\n  seed: 1\ntraining:\n  seed: 2\n")],
         "key 'training' is given twice"),
        (["train", _yaml(tmp_path, "model: x\nstrategy:\n  lora_r: 8\n  lora_r: 9\n")], "key 'lora_r' is given twice"),
        (["train", _yaml(tmp_path, "model: x\nstrategee: {}\n")], "unknown key"),
        (["train", _yaml(tmp_path, "- a\n- b\n")], "must be a mapping"),
        (["train", good, "--set", "training.seed=-1"], "training.seed"),
        (["train", good, "--set", f"training.seed={2**32}"], "less than or equal to 4294967295"),
        (["train", good, "--set", "output_dir="], "output_dir: Value error, empty"),
        (["train", good, "--set", "output_dir=  "], "output_dir: Value error, empty"),
        (["train", good, "--nproc", "-1"], "--nproc -1: must be 1 or more"),
        (["train", good, "--nproc", "0"], "--nproc 0: must be 1 or more"),
        (["train", good, "--nodes", "0"], "--nodes 0: must be 1 or more"),
        (["train", good, "--set", "strategy.lora_r=many"], "lora_r"),
        (["train", good, "--set", "nonsense"], "expected KEY=VALUE"),
        (["train"], "missing RUN_FILE"),
        (["train", "--auto"], "--auto needs --model"),
        (["train", good, "--auto", "--model", world["model"]], "not both"),
    ]
    for argv, needle in cases:
        _refused(capsys, world, argv, needle)


def test_output_dir_mistakes(world, capsys, tmp_path):
    good = _run_file(world, tmp_path, "good.yaml", out=tmp_path / "fresh")
    cases = [
        (["--set", f"output_dir={world['file']}"], "is a file, not a folder"),
        (["--set", f"output_dir={world['file']}/sub"], "a file, not a folder"),
        (["--set", "output_dir=/proc/memfit-run"], "system folder"),
        (["--set", f"output_dir={world['finished']}"], "holds a finished run"),
        (["--set", f"output_dir={world['ckpt']}"], "holds checkpoints of an earlier run"),
        (["--set", f"output_dir={world['finished']}", "--resume", "--overwrite"], "contradict"),
        (["--set", f"output_dir={world['unfinished']}", "--resume"], "no complete checkpoint"),
        (["--set", f"output_dir={world['ckpt']}", "--resume", "--set", "lora.r=16"],
         "strategy.lora_r changed from 4 to 16"),
    ]
    for extra, needle in cases:
        _refused(capsys, world, ["train", good, *extra], needle, world["unfinished"])
    assert not (tmp_path / "fresh").exists()


def test_model_folder_mistakes(world, capsys, tmp_path):
    out = world["finished"]  # --overwrite: the old run must survive every refusal below
    cases = [
        (world["file"], "it is a file, not a folder"),
        (world["root"] / "no-such-model", "no such folder"),
        (world["no_config"], "has no config.json"),
        (world["cfg_not_json"], "malformed JSON"),
        (world["cfg_list"], "expected a JSON object"),
        (world["cfg_binary"], "not a text file"),
        (world["cfg_string_number"], "field 'hidden_size'"),
        (world["corrupt_weights"], "cannot be loaded"),
        (world["empty_weights"], "cannot be loaded"),
        (world["no_tokenizer"], "tokenizer"),
        (world["empty_tokenizer"], "model's vocabulary has 400; it is not this model's tokenizer"),
    ]
    for model, needle in cases:
        path = _run_file(world, tmp_path, out=out)
        _refused(capsys, world, ["train", path, "--overwrite", "--set", f"model={model}",
                                 "--set", "strategy.lora_targets=[all-linear]"], needle)


DATA_CASES = [
    ("data_latin1", "auto", "latin1.jsonl:1: not UTF-8 text (byte 0xe9 at column 16)"),
    ("data_chat_number", "chat", "messages[0].content must be text, got int"),
    ("data_chat_role", "chat", "messages[0].role 'sytem' is not a role the chat template accepts"),
    ("data_all_empty", "auto", "every one of the 2 records is empty"),
    ("data_all_empty_text", "auto", "every one of the 2 records is empty"),
    ("data_not_json", "auto", "not_json.jsonl:2: not valid JSON"),
    ("data_list_line", "auto", "expected a JSON object, got list"),
    ("data_missing_field", "prompt_completion", "missing field(s) completion"),
    ("data_text_number", "text", "field(s) text must be text"),
    ("data_empty", "auto", "the dataset is empty"),
    ("data_unknown_fields", "auto", "cannot tell the data format"),
    ("data_txt", "auto", "is not a .jsonl file"),
    ("data_fake_dataset", "auto", "looks like a datasets folder but cannot be loaded"),
]


def test_data_mistakes(world, capsys, tmp_path):
    for key, fmt, needle in DATA_CASES:
        path = _run_file(world, tmp_path, data=world[key])
        _refused(capsys, world, ["train", path, "--overwrite", "--set", f"data.format={fmt}"], needle)
    path = _run_file(world, tmp_path, data=world["root"] / "nope.jsonl")
    _refused(capsys, world, ["train", path, "--overwrite"], "not found")


def test_strategy_mistakes(world, capsys, tmp_path):
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    coder = tmp_path / "coder"  # learned positions (a 64-row table): refused past them before anything loads
    GPTBigCodeForCausalLM(GPTBigCodeConfig(n_embd=32, n_layer=1, n_head=2, n_positions=64, vocab_size=300,
                                           bos_token_id=0, eos_token_id=0)).save_pretrained(coder)
    capsys.readouterr()  # save_pretrained's progress bar
    line = _refused(capsys, world, ["train", _run_file(world, tmp_path, name="coder.yaml", model=str(coder)),
                                    "--overwrite", "--set", "strategy.seq_len=96", "--set",
                                    "strategy.lora_targets=all-linear"], "cannot run on this machine: ")
    assert line.endswith(": strategy.seq_len=96 is above coder's n_positions=64: its positions are a learned table "
                         "of 64 rows (nothing stretches them); use --seq-len 64 or less (run file: strategy.seq_len)")
    path = _run_file(world, tmp_path)
    for extra, needle in [
        (["--set", "strategy.precision=fp16-mixed"], "precision=fp16-mixed on the CPU"),
        (["--set", "strategy.lora_targets=[nothing_here]"], "model has no such layer"),
    ]:
        _refused(capsys, world, ["train", path, "--overwrite", *extra], needle)


def test_auto_with_bad_data_is_one_line(world, capsys, tmp_path):
    _refused(capsys, world, ["train", "--auto", "--model", world["model"], "--data", world["data_latin1"],
                             "--out", tmp_path / "auto", "--seq-len", "64", "--json"], "not UTF-8 text")
    assert not (tmp_path / "auto").exists()


def test_auto_checks_the_data_before_it_prints_a_plan(world, capsys, tmp_path):
    """Issue 25 item 4: a bad line used to print the plan's 11 lines first, then the error."""
    no_fields = tmp_path / "no_fields.jsonl"
    no_fields.write_text('{"foo": 1}\n')
    for data, needle in [(world["data_not_json"], "not_json.jsonl:2: not valid JSON"),
                         (no_fields, "cannot tell the data format from the fields ['foo']")]:
        argv = ["train", "--auto", "--model", world["model"], "--data", data, "--out", tmp_path / "auto",
                "--seq-len", "64"]
        before = _snapshot(world["finished"], world["file"], world["ckpt"])
        code, out, err = _cli(capsys, argv)
        assert code == 2 and err.strip().splitlines() == [err.strip()] and needle in err, err
        assert out == "", out  # no plan before the refusal
        assert _snapshot(world["finished"], world["file"], world["ckpt"]) == before
        assert not (tmp_path / "auto").exists()


def test_a_locked_output_dir_is_refused(world, capsys, tmp_path):
    from memfit.train.outdir import OutputLock

    out = tmp_path / "busy"
    lock = OutputLock(out).acquire()  # another run holds it (same flock as a second process would see)
    try:
        path = _run_file(world, tmp_path, out=out)
        _refused(capsys, world, ["train", path], f"output_dir {out} is in use by another memfit run", out)
    finally:
        lock.release()
    assert list(out.iterdir()) == []  # no lock file left behind


# ------------------------------------------------------------------ measure
def test_measure_mistakes(world, capsys, tmp_path):
    model = str(world["model"])
    cases = [
        ([], "missing RUN_FILE or --model"),
        (["--model", model, "--gpus", "8xA100-80GB"], "measure runs here, on this machine"),
        (["--model", model, "--gpus", ""], "--gpus is empty"),
        (["--model", model, "--sweep", "seq_len"], "expected KEY=V1,V2"),
        (["--model", model, "--sweep", "seq_len="], "no values given"),
        (["--model", str(world["cfg_not_json"])], "malformed JSON"),
        (["--model", str(world["cfg_binary"])], "not a text file"),
        (["--model", model, "--steps", "0"], "--steps must be >= 1"),
        ([tmp_path / "nope.yaml"], "not found"),
        ([_yaml(tmp_path, "model: x\ntraining:\n  seed: 1\ntraining: {}\n")], "given twice"),
        (["--model", model, "--method", "bogus"], "method"),
    ]
    for argv, needle in cases:
        _refused(capsys, world, ["measure", *argv], needle)


# ------------------------------------------------------------------ demo
def test_demo_mistakes(world, capsys, tmp_path):
    cases = [
        (["--out", world["file"]], "is a file, not a folder"),
        (["--out", "/proc/memfit-demo"], "system folder"),
        (["--out", world["finished"]], "holds a finished run"),
        (["--out", tmp_path / "d", "--nproc", "-1"], "--nproc -1: must be 1 or more"),
        (["--out", tmp_path / "d", "--set", "training.seed=-1"], "training.seed"),
        (["--out", tmp_path / "d", "--set", "output_dir="], "empty"),
        (["--out", tmp_path / "d", "--set", "nosuch=1"], "unknown key"),
        (["--out", tmp_path / "d", "--set", "strategy.precision=fp16-mixed"], "fp16"),
    ]
    for argv, needle in cases:
        _refused(capsys, world, ["demo", "--json", *argv], needle)
    assert not (tmp_path / "d").exists()


def test_demo_nproc_launches_the_processes(world, capsys, tmp_path, monkeypatch):
    import memfit.distributed.launch as L
    from memfit.spec.run import load_run

    seen = {}

    def fake_launch(run_path, **kw):
        seen["run"], seen["kw"] = load_run(run_path), kw
        return 0

    monkeypatch.setattr(L, "launch", fake_launch)
    code, _, err = _cli(capsys, ["demo", "--json", "--out", tmp_path / "d", "--nproc", "2",
                                 "--set", "strategy.zero_stage=3"])
    assert code == 0, err
    assert seen["kw"]["nproc"] == 2 and seen["run"].distributed.nproc == 2
    assert seen["run"].strategy.zero_stage == 3 and seen["run"].output_dir == str(tmp_path / "d")
    assert not (tmp_path / "d").exists()  # the launched ranks write it, not the parent


def test_measure_accepts_gpus_local():
    from memfit.cli.measure_cmds import _hardware

    assert _hardware(None, False) == "local" and _hardware("local", False) == "local"
    assert _hardware("2xA100-80GB", True) == "2xA100-80GB"  # --trace-only predicts any pool
