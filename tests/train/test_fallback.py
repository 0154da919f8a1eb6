"""train --fallback: an injected out-of-memory stops the attempt, the run resumes from the last checkpoint
with the next plan, and the final model equals a run that used that plan from the start."""

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memfit.train.fallback import ladder, next_plan, train_with_fallback  # noqa: E402
from memfit.measure.worker import synthetic_text_records  # noqa: E402
from memfit.spec.run import run_from_dict  # noqa: E402


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("fallback")
    texts = [r["text"] for r in synthetic_text_records(50, 32, seed=1)]
    model = tiny_model_dir("fallback", texts, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                           num_key_value_heads=1, vocab_size=300, max_position_embeddings=64)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in synthetic_text_records(40, 32, seed=2)))
    return model, data, root


def _run(assets, out, **strategy):
    model, data, _ = assets
    s = {"method": "lora", "precision": "fp32", "seq_len": 32, "micro_batch_size": 1, "grad_accum": 1,
         "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "attention": "sdpa", **strategy}
    return run_from_dict({"model": str(model), "hardware": "local",
                          "data": {"path": str(data), "format": "text", "eval_fraction": 0.0},
                          "strategy": s, "output_dir": str(out),
                          "training": {"max_steps": 4, "checkpoint_interval": 1, "learning_rate": 1e-2,
                                       "seed": 0, "logging_interval": 1}})


def _adapter(out: Path) -> dict:
    from safetensors.torch import load_file

    files = list((out / "adapter").glob("*.safetensors"))
    assert files, f"no adapter written in {out}"
    return load_file(str(files[0]))


def _assert_same(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0)


def test_ladder_keeps_the_effective_batch():
    run = run_from_dict({"model": "x", "strategy": {"micro_batch_size": 4, "grad_accum": 3,
                                                    "gradient_checkpointing": True}})
    (why, s), = ladder(run)
    assert s.micro_batch_size * s.grad_accum == 12 and s.micro_batch_size == 2
    run2 = run_from_dict({"model": "x", "distributed": {"nproc": 2},
                          "strategy": {"gradient_checkpointing": True, "zero_stage": 2}})
    whys = [w for w, _ in ladder(run2)]
    assert whys == ["ZeRO stage 2→3", "offload optimizer to CPU"]


def test_memory_limit_is_read_by_the_one_size_parser(monkeypatch, tmp_path):
    from memfit.errors import MemfitError

    monkeypatch.setenv("MEMFIT_MEMORY_LIMIT", "lots")
    run = run_from_dict({"model": "x", "output_dir": str(tmp_path / "out")})
    with pytest.raises(MemfitError, match="MEMFIT_MEMORY_LIMIT: cannot read 'lots'.*128GB"):
        train_with_fallback(run)


def test_fallback_switches_on_checkpointing_and_matches_a_direct_run(assets):
    root = assets[2]
    run = _run(assets, root / "a", gradient_checkpointing=False)
    assert next_plan(run)[1].strategy.gradient_checkpointing
    result = train_with_fallback(run, inject_oom_at=3)
    log = json.loads((root / "a" / "fallback.json").read_text())
    assert [a["outcome"] for a in log["attempts"]] == ["out of memory", "finished"]
    assert "injected out-of-memory at step 3" in log["attempts"][0]["error"]
    assert log["attempts"][0]["last_checkpoint"].endswith("checkpoint-2")
    assert log["attempts"][1]["resumed_from"].endswith("checkpoint-2")
    assert log["attempts"][1]["levers"]["gradient_checkpointing"] is True
    assert result.steps == 4 and any("--fallback" in n for n in result.notes)
    assert result.resumed_from.endswith("checkpoint-2")  # resumed, not restarted from scratch

    direct = train_with_fallback(_run(assets, root / "b", gradient_checkpointing=True))
    assert direct.steps == 4
    _assert_same(_adapter(root / "a"), _adapter(root / "b"), atol=1e-6)


def test_fallback_halves_micro_batch_and_matches_a_direct_run(assets):
    root = assets[2]
    run = _run(assets, root / "c", gradient_checkpointing=True, micro_batch_size=2)
    train_with_fallback(run, inject_oom_at=2)
    log = json.loads((root / "c" / "fallback.json").read_text())
    assert log["attempts"][1]["levers"]["micro_batch_size"] == 1
    assert log["attempts"][1]["levers"]["grad_accum"] == 2
    train_with_fallback(_run(assets, root / "d", gradient_checkpointing=True, micro_batch_size=1,
                             grad_accum=2))
    _assert_same(_adapter(root / "c"), _adapter(root / "d"), atol=1e-5)


def test_memory_limit_walks_the_ladder_then_says_what_is_left(assets):
    from memfit.errors import MemfitError

    root = assets[2]
    run = _run(assets, root / "e", gradient_checkpointing=False, micro_batch_size=2)
    with pytest.raises(MemfitError, match="no lighter plan is left"):
        train_with_fallback(run, memory_limit=1)  # 1 byte: every attempt crosses the cap at step 1
    log = json.loads((root / "e" / "fallback.json").read_text())
    assert len(log["attempts"]) == 3  # as given, + checkpointing, + micro-batch 1 x accumulation 2
    assert all("MemoryLimitExceeded" in a["error"] for a in log["attempts"])
    last = log["attempts"][-1]["levers"]
    assert last["gradient_checkpointing"] and last["micro_batch_size"] == 1 and last["grad_accum"] == 2
    assert all(a["resumed_from"] is None for a in log["attempts"])  # no checkpoint was ever written


@pytest.mark.slow
def test_fallback_under_fsdp_two_processes(assets):
    """Each attempt runs under torchrun; both ranks' OOM markers end it; the next attempt resumes the
    FSDP checkpoint with checkpointing on."""
    root = assets[2]
    run = _run(assets, root / "f", method="full", fsdp="full_shard", gradient_checkpointing=False)
    raw = run.model_dump(mode="json")
    raw["distributed"]["nproc"] = 2
    run = run_from_dict(raw)
    result = train_with_fallback(run, inject_oom_at=3)
    log = json.loads((root / "f" / "fallback.json").read_text())
    assert [a["outcome"] for a in log["attempts"]] == ["out of memory", "finished"]
    assert "rank 0" in log["attempts"][0]["error"] and "rank 1" in log["attempts"][0]["error"]
    assert log["attempts"][1]["levers"]["gradient_checkpointing"] is True
    assert log["attempts"][1]["resumed_from"].endswith("checkpoint-2")
    assert result["steps"] == 4 and result["resumed_from"].endswith("checkpoint-2")


def test_a_failed_attempt_names_the_ranks_own_error():
    from memfit.train.fallback import _rank_error

    stderr = """W1201 torch/distributed/run.py:...] Setting OMP_NUM_THREADS environment variable for each process
terminate called after throwing an instance of 'gloo::EnforceNotMet'
  what():  [enforce fail at gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes. 8 vs 4
E1201 torch/distributed/elastic/multiprocessing/api.py:...] failed (exitcode: -6) local_rank: 1 (pid: 2199)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 2199
============================================================"""
    assert _rank_error(stderr) == (
        "terminate called after throwing an instance of 'gloo::EnforceNotMet' | "
        "what():  [enforce fail at gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes. 8 vs 4 | "
        "traceback : Signal 6 (SIGABRT) received by PID 2199")
    assert _rank_error("a\nb\nc\nd") == "b | c | d"  # nothing recognisable: the last three lines, as before
