"""A fork server for measured processes: ``python -m memfit.measure.forkserver``.

It imports torch / transformers / memfit's trainer once, then for every spec path read on stdin forks a
fresh child that runs :func:`memfit.measure.worker.main` (stdout and stderr to the log path given) and
answers ``pid N`` then ``exit CODE``. The server itself never trains, so every child starts from the same
clean state as a new interpreter, minus the ~10–20 s of imports. Started with the measurement
environment (``MALLOC_MMAP_THRESHOLD_``), which the children inherit.
"""

from __future__ import annotations

import os
import sys


def _child(spec: str, log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 1
    try:
        from memfit.measure.worker import main

        code = main([spec])
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported through the log and the exit code
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    import torch  # noqa: F401  (preload; CUDA is not initialised here)
    import transformers  # noqa: F401
    from transformers import Trainer, TrainerCallback  # noqa: F401

    import memfit.measure.callback  # noqa: F401
    import memfit.train.api  # noqa: F401

    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        spec, _, log = line.rstrip("\n").partition("\t")
        if not spec:
            continue
        pid = os.fork()
        if pid == 0:
            _child(spec, log)
        out.write(f"pid {pid}\n")
        out.flush()
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        out.write(f"exit {code}\n")
        out.flush()


if __name__ == "__main__":
    serve()
