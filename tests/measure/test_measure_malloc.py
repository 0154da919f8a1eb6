"""memfit measure's timed steps run with glibc as a training process settles, after its RSS steps ran under
the harness's 64 KiB mmap threshold (memfit.measure.probe.settle_malloc)."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from memfit.measure.baton import timed_steps

CHILD = r"""
import resource, torch
from memfit.measure.probe import settle_malloc
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        x = torch.ones(1 << 18)  # 1 MB: above 64 KiB, below 32 MiB
        del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults()
print(faults(), settle_malloc(), faults(), faults())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_settle_malloc_stops_the_page_faults_of_every_new_tensor():
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    before, threshold, _, after = out.stdout.split()
    assert threshold == str(32 << 20)
    assert int(before) >= 20 * 200 and int(after) < 50, out.stdout  # 256 pages per fresh 1 MB mapping


def test_settle_malloc_leaves_a_process_alone_without_the_harness_threshold(monkeypatch):
    from memfit.measure.probe import settle_malloc, settles_malloc

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert not settles_malloc() and settle_malloc() is None


def test_timing_starts_two_steps_later_when_malloc_settles():
    # warm-up 1, probed 1, step 2 still counts for the RSS, step 3 re-warms under the new malloc
    assert timed_steps(1, 3, 1, settle=True) == ([4, 5], 7)


def test_probe_callback_settles_malloc_after_the_rss_steps(monkeypatch):
    from memfit.measure import probe as P
    from memfit.measure.callback import ProbeCallback

    calls = []
    monkeypatch.setattr(P, "settles_malloc", lambda: True)
    monkeypatch.setattr(P, "settle_malloc", lambda: calls.append("settled") or (32 << 20))
    monkeypatch.setattr(P, "TensorMemoryProbe", lambda *a, **kw: SimpleNamespace(start=lambda: SimpleNamespace(
        stop=lambda: None)))
    cb = ProbeCallback(warmup=1, steps=3)
    for k in range(7):
        cb.on_step_begin(None, SimpleNamespace(global_step=k, max_steps=7), None)
        calls.append(k)
        cb.on_step_end(None, SimpleNamespace(global_step=k + 1, max_steps=7), None)
    assert calls == [0, 1, 2, "settled", 3, 4, 5, 6]
    assert len(cb._times) == 2 and cb._timed_threshold == 32 << 20
