"""A rank that fails: one line naming it, every process ends within ``distributed.timeout_s``, the run
folder left resumable.

* In each training process (``python -m memfit.train``): an exception on one rank (a bad batch, an
  out-of-memory error) is reported as ``error: rank R of W (node N): <type>: <message>`` and the process
  ends at once (:func:`fail_fast`: no barrier, no interpreter shutdown waiting on the peers). The peers'
  next collective then fails (gloo: connection closed) or gives up after ``distributed.timeout_s``; they
  report ``lost a peer`` the same way. A rank killed outright (kill -9, the kernel's OOM killer) says
  nothing; its peers still end the same way.
* In ``memfit launch``: torchrun's output passes through; :func:`root_cause` reads its failure report
  (the first rank to fail, its exit code or signal) and the ranks' own lines into one line.
* Checkpoints are complete or absent (memfit.train.checkpoint: staged, renamed when every rank wrote its
  part), so ``--resume`` continues from the newest complete one.

``MEMFIT_FAULT_DRILL=RANK:STEP:KIND`` (KIND: ``kill``, ``raise``, ``oom``, ``hang``: sleeps, alive but
silent) makes rank RANK fail that way when it starts step STEP: the tests' and a user's drill of the above
(:func:`drill_callback`).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, NoReturn, Optional

DRILL_ENV = "MEMFIT_FAULT_DRILL"
KINDS = ("kill", "raise", "oom", "hang")
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "timed out", "timeout",
              "broken pipe", "socket closed", "connection refused")


def _parse_drill(text: str) -> tuple[int, int, str]:
    from memfit.errors import ConfigError

    parts = text.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in KINDS:
        raise ConfigError(f"{DRILL_ENV}={text!r}: give RANK:STEP:KIND with KIND one of {', '.join(KINDS)} "
                          f"(e.g. {DRILL_ENV}=1:3:kill), or unset it")
    return int(parts[0]), int(parts[1]), parts[2]


def drill_callback(environ: Optional[dict] = None) -> Optional[Any]:
    """A TrainerCallback that makes one rank fail at the start of one step (None without the variable)."""
    text = (os.environ if environ is None else environ).get(DRILL_ENV)
    if not text:
        return None
    rank, step, kind = _parse_drill(text)
    from transformers import TrainerCallback

    from memfit.distributed.ranks import rank_info

    class FaultDrill(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if rank_info()[0] != rank or state.global_step + 1 != step:
                return
            if kind == "kill":
                import signal

                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "hang":  # its peers give up after distributed.timeout_s
                import time

                time.sleep(10 ** 6)
            if kind == "oom":
                import torch

                raise torch.OutOfMemoryError(f"injected out-of-memory on rank {rank} at step {step} (drill)")
            raise RuntimeError(f"injected failure on rank {rank} at step {step} (drill)")

    return FaultDrill()


def where() -> str:
    """``rank 1 of 2 (node 1)``: this process, as its lines name it."""
    from memfit.distributed.ranks import this_process

    me = this_process()
    return f"rank {me['rank']} of {me['world_size']} (node {me['node_rank']})"


def failure_line(err: BaseException) -> str:
    """``rank 1 of 2 (node 1): RuntimeError: ...`` for this process's failure, in one line."""
    text = " ".join(str(err).split())[:300] or type(err).__name__
    where_ = where()
    if any(s in text.lower() for s in _PEER_LOST):
        return (f"{where_}: lost a peer rank in a collective ({type(err).__name__}: {text}); the rank that "
                "failed first is named by its own line or by the launcher")
    if type(err).__name__ == "OutOfMemoryError":
        return (f"{where_}: out of memory: {text}; lower strategy.micro_batch_size or seq_len, or shard more "
                "(memfit plan RUN.yaml)")
    return f"{where_}: {type(err).__name__}: {text}"


def fail_fast(code: int = 1) -> NoReturn:
    """End this process now: flush what it printed, skip interpreter shutdown (whose teardown of a
    process group still in use by failing peers can block or abort). The output folder's lock is an
    ``flock``: the kernel releases it."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe must not keep the process alive
            pass
    os._exit(code)


_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)"
                      r"\s*\(pid:\s*\d+\)[ \t]*\(?([A-Z0-9]*)\)?")
_RANK_LINE = re.compile(r"error: (rank (\d+) of \d+ .*)$", re.M)


def root_cause(output: str) -> Optional[str]:
    """One line from torchrun's failure report and the ranks' ``error: rank ...`` lines in ``output``:
    the first rank to fail and why. None when the output holds neither."""
    lines = {int(m.group(2)): m.group(1) for m in reversed(list(_RANK_LINE.finditer(output)))}
    cause = output.rfind("Root Cause")
    report = output[cause:] if cause >= 0 else output
    failures = [(int(m.group(1)), int(m.group(3)), m.group(4)) for m in _FAILURE.finditer(report)]
    failures += [(int(m.group(1)), int(m.group(3)), m.group(4)) for m in _FAILURE.finditer(output)
                 if cause < 0 or m.start() < cause]
    for rank, code, signame in failures:  # the root cause first, then the other failures torchrun saw
        if rank in lines and "lost a peer" not in lines[rank]:
            return lines[rank]
        timed_out = any("timed out" in line.lower() for line in lines.values())
        if code < 0 and signame == "SIGTERM" and timed_out:  # torchrun stopped it after a peer's timeout
            return (f"rank {rank} did not answer within distributed.timeout_s (hung; its peers timed out, "
                    "torchrun stopped it)")
        if code < 0:
            return (f"rank {rank} was killed by {signame or f'signal {-code}'} (no error of its own: killed "
                    "from outside, or out of host memory)")
    own = [line for line in lines.values() if "lost a peer" not in line]
    if own or lines:
        return (own or list(lines.values()))[0]
    return f"rank {failures[0][0]} exited with code {failures[0][1]}" if failures else None
