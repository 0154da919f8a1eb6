"""Processes at once on a CPU: the slowdown measured with the collectives scales each one's work."""

import pytest

from memfit.estimate import estimate
from memfit.spec.strategy import Strategy
from test_time_model import BASE, TINY, cpu_pool


def test_processes_at_once_run_slower_by_the_measured_factor(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    st = Strategy(**{**BASE, "precision": "fp32"})
    coll = {"backend": "gloo", "bus_bytes_per_s": 1e9, "latency_s": 1e-4}
    plain = estimate(TINY, cpu_pool(2, collectives={"2": coll}), st).time
    slowed = estimate(TINY, cpu_pool(2, collectives={"2": {**coll, "concurrency": {"gemm": 1.5, "ops": 2.0}}}),
                      st).time
    # GEMMs and attention 1.5x slower, every host cost (dispatch per layer, the Trainer's loop) 2x
    assert slowed["matmul_seconds"] == pytest.approx(1.5 * plain["matmul_seconds"])
    assert slowed["attention_seconds"] == pytest.approx(1.5 * plain["attention_seconds"])
    assert slowed["dispatch_seconds"] == pytest.approx(2.0 * plain["dispatch_seconds"])
    assert slowed["trainer_seconds"] - 4 * 1e-4 == pytest.approx(2.0 * (plain["trainer_seconds"] - 4 * 1e-4))
    # memory-bound work already shares the bandwidth measured with both processes' threads running
    assert slowed["memory_bound_seconds"] == pytest.approx(plain["memory_bound_seconds"])
    # one process alone: the factor is not applied
    alone = estimate(TINY, cpu_pool(1, collectives={"2": {**coll, "concurrency": {"gemm": 1.5, "ops": 2.0}}}), st).time
    assert alone["matmul_seconds"] == pytest.approx(estimate(TINY, cpu_pool(1), st).time["matmul_seconds"])
