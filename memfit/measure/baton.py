"""Step-interleaved measurement: several measured runs alive at once, one training step at a time.

A shared machine's speed drifts by ±20-30 % within seconds (docs/time.md), so configurations measured
one after another are compared at different speeds, and a pair 10-20 % apart can swap places. Here every
configuration still trains in its own fresh process through memfit's trainer, but a coordinator passes a
baton: a process runs a step only when it holds it, and hands it back when the step ends, so the
configurations' steps alternate (A B C A B C ...) and each one meets the same moments of the machine.

Nothing runs beside a step but the other processes' own short work between steps (logging, fetching the
next batch): they start, import and build their models before the first baton, and after their last step
they wait until every other process has finished its own before tearing down.

A process holds the baton for ``turn`` consecutive steps (2 by default) and only the later ones are timed:
a step that follows other processes' work runs slower than one that follows its own previous step — a
dispatch-bound 1 x 128 LoRA step read 27-29 ms after 0.1 s of other work (a Python loop, a matmul, a
sleep), 20-24 ms back to back, 23-24 ms after one re-warming step (bench/step_warmth.py),
and a user's run steps back to back.

Wire protocol (named pipes in one folder, each write under ``PIPE_BUF`` so it is atomic): every process
writes ``"<name> ready"`` / ``"<name> done"`` / ``"<name> last"`` lines to ``coordinator``; the coordinator
writes one byte to ``<name>.go`` to let it step (and once more to release it after its last step). In a
multi-process run rank 0 holds the baton and the other ranks wait for it in a barrier.
"""

from __future__ import annotations

import os
import select
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

READY, DONE, LAST = "ready", "done", "last"


def _fifo(path: Path) -> int:
    """Open a named pipe (created if absent) read-write: neither side blocks on open or sees EOF."""
    if not path.exists():
        os.mkfifo(path)
    return os.open(path, os.O_RDWR)


def timed_steps(warmup: int, steps: int, turn: int = 1, settle: bool = False) -> tuple[list[int], int]:
    """(the 0-based steps whose loop iteration is timed, the steps the run needs) for ``warmup`` steps, one
    probed step and ``steps - 1`` timed ones, holding the baton ``turn`` steps at a time: the first step of
    each turn (a multiple of ``turn``) re-warms and is not timed; one more step ends the last timed one.
    ``settle``: the step after the probed one still counts for the RSS, then malloc changes
    (memfit.measure.probe.settle_malloc) and one step re-warms: timing starts two steps later."""
    timed, step = [], warmup + 1 + (2 if settle else 0)
    while len(timed) < steps - 1:
        if turn <= 1 or step % turn:
            timed.append(step)
        step += 1
    return timed, (timed[-1] + 2 if timed else warmup + 1)


class Gate:
    """A measured process's side: ``before_step`` blocks until the baton arrives, ``after_step`` hands it
    back (and after the last step waits for the release); ``turn``: steps per baton."""

    def __init__(self, folder: str, name: str, turn: int = 1) -> None:
        self.name, self.turn = name, max(1, int(turn))
        self._to = _fifo(Path(folder) / "coordinator")
        self._go = _fifo(Path(folder) / f"{name}.go")

    def _say(self, what: str) -> None:
        os.write(self._to, f"{self.name} {what}\n".encode())

    def _wait(self) -> None:
        os.read(self._go, 1)

    def before_step(self) -> None:
        if _rank() == 0:
            self._say(READY)
            self._wait()
        _barrier()

    def after_step(self, last: bool) -> None:
        _barrier()
        if _rank() == 0:
            self._say(LAST if last else DONE)
            if last:
                self._wait()  # released once every process has run all its steps
        if last:
            _barrier()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class Coordinator:
    """The bench's side: ``run(names, alive)`` hands the baton round-robin to the named processes once all
    of them are ready for their first step, until each has run its last; ``alive(name)`` says whether a
    process still runs (one that died is dropped, never waited for)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._from = _fifo(self.folder / "coordinator")
        self._buf = b""
        self._go: dict[str, int] = {}

    def gate_spec(self, name: str, turn: int = 2) -> dict:
        """What a measured process needs to find its gate (memfit.measure.worker reads ``baton``)."""
        self._go[name] = _fifo(self.folder / f"{name}.go")
        return {"folder": str(self.folder), "name": name, "turn": turn}

    def _next(self, alive: Callable[[str], bool], waiting: Iterable[str]) -> Optional[tuple[str, str]]:
        """The next (name, word) a process wrote; None when every process waited for has died."""
        while b"\n" not in self._buf:
            if not any(alive(n) for n in waiting):
                return None
            ready, _, _ = select.select([self._from], [], [], 1.0)
            if ready:
                self._buf += os.read(self._from, 4096)
        line, _, self._buf = self._buf.partition(b"\n")
        name, _, word = line.decode().partition(" ")
        return name, word

    def _step(self, name: str, alive: Callable[[str], bool]) -> Optional[str]:
        """Hand ``name`` the baton for one step: its word after the step (done / last), None if it died."""
        os.write(self._go[name], b"g")
        while True:  # other processes' "ready" lines (they wait between steps) are not answers
            got = self._next(alive, [name])
            if got is None or (got[0] == name and got[1] != READY):
                return None if got is None else got[1]

    def run(self, names: list[str], alive: Callable[[str], bool], timeout: float = 3600.0) -> None:
        live, ready, start = list(names), set(), time.monotonic()
        while ready != set(live):  # everyone started, imported, built its model: no start-up beside a step
            got = self._next(alive, [n for n in live if n not in ready])
            live = [n for n in live if alive(n) or n in ready]
            if got is None:
                break
            if got[1] == READY:
                ready.add(got[0])
        finished: list[str] = []
        while live and time.monotonic() - start < timeout:
            for name in list(live):
                word = self._step(name, alive)
                if word in (None, LAST):
                    live.remove(name)
                    if word == LAST:
                        finished.append(name)
        for name in finished:  # every process has run its steps: let them all tear down
            os.write(self._go[name], b"g")

    def close(self) -> None:
        for fd in [self._from, *self._go.values()]:
            try:
                os.close(fd)
            except OSError:
                pass
