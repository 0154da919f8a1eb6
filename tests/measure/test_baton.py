"""Step-interleaved measurement (memfit.measure.baton): one step at a time, in turn, once all are ready."""

import threading
import time
from types import SimpleNamespace

from memfit.measure.baton import Coordinator, Gate


def _worker(folder, name, steps, log, lock, delay=0.0):
    time.sleep(delay)  # a slow start-up (imports, model build): nobody may step before it is ready
    with lock:
        log.append((name, -1, "up", time.monotonic()))
    gate = Gate(folder, name)
    for k in range(steps):
        gate.before_step()
        with lock:
            log.append((name, k, "start", time.monotonic()))
        time.sleep(0.01)
        with lock:
            log.append((name, k, "end", time.monotonic()))
        gate.after_step(last=k == steps - 1)
    with lock:
        log.append((name, steps, "released", time.monotonic()))


def test_steps_alternate_one_at_a_time_after_everyone_is_ready(tmp_path):
    co = Coordinator(tmp_path / "baton")
    names, log, lock = ["a", "b", "c"], [], threading.Lock()
    specs = {n: co.gate_spec(n) for n in names}
    threads = {n: threading.Thread(target=_worker, args=(specs[n]["folder"], n, 3, log, lock, 0.3 if n == "c" else 0.0))
               for n in names}
    for t in threads.values():
        t.start()
    co.run(names, lambda n: threads[n].is_alive())
    for t in threads.values():
        t.join(10)
    co.close()
    steps = [e for e in log if e[2] in ("start", "end")]
    # strictly one step at a time: start, end, start, end ...
    assert [e[2] for e in steps] == ["start", "end"] * 9
    # round-robin in the order given, every process's steps in turn
    assert [(e[0], e[1]) for e in steps if e[2] == "start"] == [(n, k) for k in range(3) for n in names]
    # the late starter was waited for; nobody was released before the last step of all
    assert min(e[3] for e in steps) >= next(e[3] for e in log if e[0] == "c" and e[2] == "up")
    last_end = max(e[3] for e in steps)
    assert all(e[3] >= last_end for e in log if e[2] == "released")


def test_a_process_that_dies_before_its_first_step_is_not_waited_for(tmp_path):
    co = Coordinator(tmp_path / "baton")
    log, lock = [], threading.Lock()
    spec = co.gate_spec("a")
    co.gate_spec("dead")  # never starts
    t = threading.Thread(target=_worker, args=(spec["folder"], "a", 2, log, lock))
    t.start()
    co.run(["a", "dead"], lambda n: n == "a" and t.is_alive(), timeout=30)
    t.join(10)
    co.close()
    assert [(e[0], e[1], e[2]) for e in log if e[2] != "up"] == [("a", 0, "start"), ("a", 0, "end"), ("a", 1, "start"),
                                                  ("a", 1, "end"), ("a", 2, "released")]


class _FakeProbe:
    """Stands in for the memory probe (started on the first measured step, stopped at its end)."""

    def __init__(self, *a, **kw):
        pass

    def start(self):
        return self

    def stop(self):
        return None


def test_probe_callback_holds_the_gate_over_whole_loop_iterations(monkeypatch):
    """The baton passes at on_step_begin (the previous iteration's logging and the next batch's fetch ran
    under it) and is given back for good after the final step, the one that ends the last timed one."""
    from memfit.measure.callback import ProbeCallback

    calls = []
    gate = SimpleNamespace(before_step=lambda: calls.append("before"),
                           after_step=lambda last: calls.append(f"after last={last}"))
    monkeypatch.setattr("memfit.measure.probe.TensorMemoryProbe", _FakeProbe)
    cb = ProbeCallback(warmup=0, steps=2, gate=gate)
    for k in range(3):  # the probed step, the timed one, the step that ends the timed iteration
        cb.on_step_begin(None, SimpleNamespace(global_step=k, max_steps=10), None)
        calls.append(f"step {k}")
        cb.on_step_end(None, SimpleNamespace(global_step=k + 1, max_steps=10), None)
    assert calls == ["before", "step 0", "after last=False", "before", "step 1",
                     "after last=False", "before", "step 2", "after last=True"]
    assert len(cb._times) == 1  # step 1's iteration, recorded when step 2 began


def test_the_timed_window_is_the_whole_loop_iteration(monkeypatch):
    """Work between on_step_end and the next on_step_begin (the Trainer's logging, its gathers, fetching
    the next batch) is part of the timed step."""
    from memfit.measure.callback import ProbeCallback

    monkeypatch.setattr("memfit.measure.probe.TensorMemoryProbe", _FakeProbe)
    cb = ProbeCallback(warmup=0, steps=3)
    for k in range(4):
        cb.on_step_begin(None, SimpleNamespace(global_step=k, max_steps=4), None)
        time.sleep(0.01)  # the step proper
        cb.on_step_end(None, SimpleNamespace(global_step=k + 1, max_steps=4), None)
        time.sleep(0.03)  # outside the step: logging, the next batch
    assert len(cb._times) == 2 and all(0.04 <= t < 0.2 for t in cb._times), cb._times


def test_timed_steps_by_turn():
    from memfit.measure.baton import timed_steps

    # warm-up 1, probed step 1, 3 timed; one step per baton: 2, 3, 4 timed, step 5 ends the last
    assert timed_steps(1, 4, 1) == ([2, 3, 4], 6)
    # two steps per baton (turns start at even steps): each turn's first step re-warms, untimed
    assert timed_steps(1, 4, 2) == ([3, 5, 7], 9)
    assert timed_steps(2, 1, 2) == ([], 3)  # the probed step only


def test_probe_callback_times_only_the_second_step_of_each_turn(monkeypatch):
    from memfit.measure.callback import ProbeCallback

    monkeypatch.setattr("memfit.measure.probe.TensorMemoryProbe", _FakeProbe)
    calls = []
    gate = SimpleNamespace(turn=2, before_step=lambda: calls.append("before"),
                           after_step=lambda last: calls.append(f"after last={last}"))
    cb = ProbeCallback(warmup=1, steps=3, gate=gate)  # probed 1; timed 3, 5; step 6 ends step 5's iteration
    for k in range(7):
        cb.on_step_begin(None, SimpleNamespace(global_step=k, max_steps=20), None)
        calls.append(k)
        cb.on_step_end(None, SimpleNamespace(global_step=k + 1, max_steps=20), None)
    assert calls == ["before", 0, 1, "after last=False", "before", 2, 3, "after last=False", "before", 4, 5,
                     "after last=False", "before", 6, "after last=True"]
    assert len(cb._times) == 2
