"""Every rank of a job ends when the job has ended elsewhere, even a rank that hangs outside a collective.

On one node torchrun stops the other workers as soon as one fails. Across nodes nobody does: each node's
torchrun watches only its own workers, so a rank of node 1 that hangs outside a collective (stuck in data
loading, a deadlocked thread, the ``hang`` drill) outlives the job for ever after node 0's ranks have
timed out and ended (seen in tests/distributed/test_fault_matrix_full.py: node 1's launcher still running at 180 s).

A rank that fails says so in the job's rendezvous store (:func:`mark_failed`, the key ``memfit/failed``),
and every rank runs a daemon thread (:func:`watch_job`) that reads the store every few seconds through a
connection of its own: when another rank has failed and this process is still alive ``GRACE_S`` later
(torchrun on its node did not stop it), or when the store has gone (node 0's launcher, which hosts it,
ended), it prints one line and ends the process. The store is torchrun's own TCPStore at
``MASTER_ADDR:MASTER_PORT`` (the agent hosts it on node 0; the workers use it with
``TORCHELASTIC_USE_AGENT_STORE``; torch/distributed/elastic/agent/server/api.py, rendezvous/
static_tcp_rendezvous.py). After a run that ends well the store outlives every worker: each node's
torchrun waits in its exit barrier until all nodes' workers are done.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Optional

FAILED_KEY = "memfit/failed"
PERIOD_S = 2.0  # how often the store is read
GRACE_S = 15.0  # a failure elsewhere: time for this node's torchrun to stop this process first

_store: Optional[Any] = None
_stop = threading.Event()
_thread: Optional[threading.Thread] = None


def _connect() -> Optional[Any]:
    """A client connection of this process's own to the job's store (None outside a multi-process job)."""
    global _store
    if _store is None and int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get("MASTER_ADDR"):
        from datetime import timedelta

        import torch.distributed as dist

        _store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                               timeout=timedelta(seconds=10), wait_for_workers=False)
    return _store


def mark_failed(line: str) -> None:
    """Tell the other ranks (through the store) that this rank failed and why; best effort."""
    try:
        store = _connect()
        if store is not None:
            store.set(FAILED_KEY, line)
    except Exception:  # noqa: BLE001 - the store may be gone already; the process ends anyway
        pass


def watch_job(where: str) -> Optional[threading.Thread]:
    """Start the daemon thread that ends this process once the job has ended elsewhere (None when this is
    not a multi-process torchrun job). ``where``: this rank, as its lines name it.

    One thread per process: a process that trains several runs in one job (memfit.measure.engine_matrix)
    keeps the thread the first run started. Six threads, five of them never joined, were alive at the exit
    of tests/distributed/test_chunked_distributed.py's ranks; one caught inside a store call at interpreter shutdown
    aborts the process (see :func:`stop_watch`)."""
    global _thread
    if _thread is not None and _thread.is_alive():
        return _thread
    try:
        store = _connect()
    except Exception:  # noqa: BLE001 - no store to watch (not started by torchrun): nothing to do
        return None
    if store is None:
        return None
    import atexit

    _stop.clear()
    _thread = threading.Thread(target=_watch, args=(store, where), name="memfit-job-watch", daemon=True)
    _thread.start()
    atexit.unregister(stop_watch)  # once, however many runs this process trains
    atexit.register(stop_watch)
    return _thread


def stop_watch() -> None:
    """End the watch thread and drop the store client while the interpreter is whole (at exit).

    A daemon thread still inside the store's C++ client when the interpreter finalizes is ended by Python
    (pthread_exit as it retakes the GIL) through C++ frames that cannot unwind: std::terminate, "terminate
    called without an active exception", SIGABRT (tests/distributed/test_job_watch.py shows it with a bare thread)."""
    global _store, _thread
    _stop.set()
    if _thread is not None and _thread is not threading.current_thread():
        _thread.join(timeout=15)
    _thread = None
    _store = None


def _watch(store: Any, where: str) -> None:
    from memfit.distributed.faults import fail_fast

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    seen: Optional[float] = None
    while not _stop.wait(PERIOD_S):
        line = _failed_line(store, host, port)
        if line is None:  # node 0's launcher (the store's host) has ended
            _say(f"error: {where}: stopped: the job's rendezvous store at {host}:{port} closed (node 0's "
                 "processes ended) while this rank was still running")
            fail_fast(1)
        if line:
            seen = seen or time.monotonic()
            if time.monotonic() - seen >= GRACE_S:
                _say(f"error: {where}: stopped: the job ended after another rank failed ({line})")
                fail_fast(1)


def _failed_line(store: Any, host: str, port: int) -> Optional[str]:
    """Another rank's failure line ("" while none failed); None when the store is gone. The port is probed
    first: the store client logs a C++ stack when its server has gone."""
    if not _listening(host, port):
        return None
    try:
        return store.get(FAILED_KEY).decode(errors="replace") if store.check([FAILED_KEY]) else ""
    except Exception:  # noqa: BLE001 - it went between the probe and the read
        return None


def _listening(host: str, port: int) -> bool:
    """Whether something still accepts connections at ``host:port`` (a plain connect, closed at once)."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False


def _say(text: str) -> None:
    try:
        print(text, file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - a closed pipe must not keep the process alive
        pass
