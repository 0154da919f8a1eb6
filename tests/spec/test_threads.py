"""The CPU threads a run's processes use are the threads its prediction is made at (issue 21, item 0).

Without OMP_NUM_THREADS, ``memfit measure`` predicted at all the cores while the measured process took
fewer by the load average (memfit.train.api.cpu_threads): -48...-60 % on the step time. One rule now
(memfit.spec.threads.run_threads) gives the count, the prediction reads it and the runner hands it to the
processes it starts; the load average never enters a measured run.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from memfit.spec import threads as th

torch = pytest.importorskip("torch")

MIN_CORES = 2  # one core: every rule gives 1 thread, nothing to tell apart


@pytest.fixture
def busy_machine(monkeypatch):
    """OMP_NUM_THREADS unset (and restored after, whatever the code under test sets), a load average of
    one more than the cores (the load-average rule would give 1 thread), torch at all the cores."""
    if th.cores() < MIN_CORES:
        pytest.skip("needs 2 cores or more")
    monkeypatch.setenv(th.ENV, "1")  # recorded, so the delete below is undone too
    monkeypatch.delenv(th.ENV)
    monkeypatch.setattr(os, "getloadavg", lambda: (th.cores() + 1.0, 0.0, 0.0))
    before = torch.get_num_threads()
    torch.set_num_threads(th.cores())
    yield th.cores()
    torch.set_num_threads(before)


def _hw(processes: int):
    return SimpleNamespace(gpus_per_node=processes)  # all threads_per_process reads


def test_rule(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    assert th.run_threads(2, environ={}) == 2
    assert th.run_threads(3, environ={}) == 1
    assert th.run_threads(8, environ={}) == 1
    assert th.run_threads(2, environ={th.ENV: "3"}) == 3
    assert th.run_threads(2, environ={th.ENV: "0"}) == 2  # not a thread count: the cores rule
    with th.pinned(5):
        assert th.run_threads(2) == 5
    assert th._PINNED is None
    monkeypatch.setattr(os, "getloadavg", lambda: (2.6, 0.0, 0.0))
    assert th.idle_cores() == 1 and th.idle_cores(limit=8) == 1
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.0, 0.0))
    assert th.idle_cores() == 4 and th.idle_cores(limit=2) == 2


def test_measured_process_runs_the_predicted_threads(busy_machine, monkeypatch, tmp_path):
    """``memfit measure`` of one process, with the fork server's child run in this process up to the
    trainer: the threads torch runs there equal those the prediction was made at."""
    from memfit.steptime.speeds import threads_per_process
    from memfit.measure import runner, worker
    from memfit.spec.run import run_from_dict
    from memfit.train import api

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 50000}))
    run = run_from_dict({"model": str(model), "hardware": "local",
                         "strategy": {"method": "lora", "precision": "fp32", "micro_batch_size": 1,
                                      "seq_len": 16}, "output_dir": str(tmp_path / "out")}, source="test")
    seen: dict = {}

    def predict(run, profile=None):  # what the estimator reads: threads_per_process of the run's pool
        seen["predicted"] = threads_per_process(_hw(run.distributed.nproc))
        return {}

    def train(run, callbacks=(), data=None):  # the trainer's own choice first, as api.train makes it
        api.cpu_threads()
        seen["ran"] = torch.get_num_threads()
        seen["ran_predicts"] = threads_per_process(_hw(run.distributed.nproc))  # its in-process estimate
        rank = {"rank": 0, "device": "cpu", "peak_allocated_bytes": 1, "components": {}, "step_seconds": 1.0}
        with open(seen["out"], "w") as fh:
            json.dump(rank, fh)

    def run_forked(spec_path, log, timeout):  # the fork server's child, in this process
        seen["out"] = json.loads(open(spec_path).read())["out"].replace("{rank}", "0")
        return worker.main([str(spec_path)])

    monkeypatch.setattr(runner, "predict", predict)
    monkeypatch.setattr(runner, "compare", lambda p, m: {"error_pct": {}, "rows": []})
    monkeypatch.setattr(runner, "_run_forked", run_forked)
    monkeypatch.setattr(api, "train", train)
    rec = runner.measure(run, warmup=0, steps=1)
    assert seen["ran"] == seen["predicted"] == seen["ran_predicts"], seen
    assert seen["ran"] == busy_machine  # the planned count (all cores), not the load average's 1
    assert rec["measured"]["threads"] == seen["ran"]

    seen.clear()
    rec = runner.measure(run, warmup=0, steps=1, threads=1)  # an explicit count: predicted at it too
    assert seen["ran"] == seen["predicted"] == 1, seen


def test_multiprocess_measure_gives_torchrun_the_predicted_threads(busy_machine, monkeypatch, tmp_path):
    """Under torchrun (which sets 1 thread where OMP_NUM_THREADS is unset) every rank gets the count the
    prediction used."""
    from memfit.errors import MemfitError
    from memfit.steptime.speeds import threads_per_process
    from memfit.measure import runner
    from memfit.spec.run import run_from_dict

    run = run_from_dict({"model": str(tmp_path), "hardware": "local", "distributed": {"nproc": 2},
                         "strategy": {"method": "lora", "precision": "fp32", "micro_batch_size": 1,
                                      "seq_len": 16}, "output_dir": str(tmp_path / "out")}, source="test")
    seen: dict = {}

    def predict(run, profile=None):
        seen["predicted"] = threads_per_process(_hw(run.distributed.nproc))
        return {}

    def fake_run(cmd, env=None, **kw):
        seen["env"] = env
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(runner, "predict", predict)
    monkeypatch.setattr(runner.subprocess, "run", fake_run)
    with pytest.raises(MemfitError, match="no figures"):  # nothing ran: only the environment is looked at
        runner.measure(run, warmup=0, steps=1)
    assert seen["env"][th.ENV] == str(seen["predicted"]) == str(busy_machine // 2)


def test_launcher_and_prediction_share_the_rule(monkeypatch):
    """memfit's launcher gives each process the count a prediction for that many processes reads, also
    where this process may use fewer cores than the machine has (taskset, a container's cpuset)."""
    from memfit.distributed.launch import launch_env
    from memfit.steptime.speeds import threads_per_process

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    monkeypatch.setenv(th.ENV, "1")
    monkeypatch.delenv(th.ENV)
    for nproc in (2, 4, 8):
        env = launch_env({"PATH": "/bin"}, nproc=nproc)
        assert env[th.ENV] == str(threads_per_process(_hw(nproc))) == str(max(1, 4 // nproc))


def test_in_process_train_predicts_what_it_picked(busy_machine):
    """An in-process ``memfit train`` may take fewer threads on a busy machine; its prediction, made in
    the same process, reads that choice."""
    from memfit.steptime.speeds import threads_per_process
    from memfit.train.api import cpu_threads

    if torch.cuda.is_available():
        pytest.skip("CPU threads are chosen on CPU-only machines")
    assert cpu_threads() == 1
    assert threads_per_process(_hw(1)) == torch.get_num_threads() == 1
