"""memfit.distributed.watch: a rank that is still alive after the job ended elsewhere ends itself, in one
line (the whole 2-node case: tests/distributed/test_fault_matrix_full.py, ``hang`` on 2 x 1)."""

import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from memfit.distributed.launch import free_port

# a rank that hangs outside any collective, watched (grace shortened for the test)
HUNG = ("import time, memfit.distributed.watch as w; w.GRACE_S = 1.0; w.PERIOD_S = 0.2; "
        "assert w.watch_job('rank 1 of 2 (node 1)') is not None; print('watching', flush=True); time.sleep(60)")


def _hung_rank(port: int) -> subprocess.Popen:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    p = subprocess.Popen([sys.executable, "-c", HUNG], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "watching", p.stderr.read()
    return p


@pytest.fixture
def store():
    import torch.distributed as dist

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10),
                           wait_for_workers=False)
    return port, server


def test_a_failure_elsewhere_ends_a_rank_torchrun_did_not_stop(store):
    port, server = store
    p = _hung_rank(port)
    time.sleep(0.5)
    assert p.poll() is None  # nothing failed: it keeps running
    server.set("memfit/failed", "rank 0 of 2 (node 0): RuntimeError: bad batch")
    t0 = time.monotonic()
    _, err = p.communicate(timeout=30)
    assert p.returncode == 1 and 0.8 < time.monotonic() - t0 < 10
    assert err.strip().splitlines()[-1] == ("error: rank 1 of 2 (node 1): stopped: the job ended after another rank "
                                            "failed (rank 0 of 2 (node 0): RuntimeError: bad batch)")


def test_the_store_gone_ends_a_rank_at_once():
    port = free_port()
    host = ("import sys, time, datetime, torch.distributed as d; s = d.TCPStore('127.0.0.1', %d, is_master=True, "
            "timeout=datetime.timedelta(seconds=10), wait_for_workers=False); print('up', flush=True); "
            "time.sleep(60)" % port)
    node0 = subprocess.Popen([sys.executable, "-c", host], stdout=subprocess.PIPE, text=True)
    assert node0.stdout.readline().strip() == "up"
    p = _hung_rank(port)
    node0.kill()  # node 0's launcher, which hosts the store, ended
    node0.wait()
    _, err = p.communicate(timeout=30)
    assert p.returncode == 1
    assert err.strip().splitlines() == [f"error: rank 1 of 2 (node 1): stopped: the job's rendezvous store at "
                                        f"127.0.0.1:{port} closed (node 0's processes ended) while this rank was "
                                        "still running"]  # one line: no C++ stack from the store client


def test_no_job_nothing_watched(monkeypatch):
    from memfit.distributed import watch

    monkeypatch.setattr(watch, "_store", None)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert watch.watch_job("rank 0 of 1 (node 0)") is None
    watch.mark_failed("nothing to tell")  # no store: nothing happens, nothing raised


# a process that trains several runs in one job (memfit.measure.engine_matrix) and then exits while the
# watch is busy in the store (PERIOD_S = 0: one store read after another)
SEVERAL_RUNS = ("import threading, memfit.distributed.watch as w; w.PERIOD_S = 0.0; "
                "ts = {w.watch_job('rank 0 of 2 (node 0)') for _ in range(6)}; "
                "print(len(ts), sum(t.name == 'memfit-job-watch' for t in threading.enumerate()), flush=True)")


def test_one_watch_per_process_and_it_ends_before_the_interpreter(store):
    port, _server = store
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    for _ in range(3):
        p = subprocess.run([sys.executable, "-c", SEVERAL_RUNS], env=env, capture_output=True, text=True,
                           timeout=60)
        assert (p.returncode, p.stdout.split()) == (0, ["1", "1"]), p.stderr[-2000:]
        assert "terminate called" not in p.stderr


def test_stop_watch_ends_the_thread(store, monkeypatch):
    import threading

    from memfit.distributed import watch

    port, _server = store
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(watch, "_store", None)
    monkeypatch.setattr(watch, "PERIOD_S", 0.01)
    first = watch.watch_job("rank 0 of 2 (node 0)")
    assert watch.watch_job("rank 0 of 2 (node 0)") is first and first.is_alive()
    watch.stop_watch()
    assert not first.is_alive()
    assert not [t for t in threading.enumerate() if t.name == "memfit-job-watch"]
