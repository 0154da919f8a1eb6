"""One rank of a multi-process ``--fallback`` attempt (started by torchrun from memfit.train.fallback).

It trains the attempt's run file; when this rank runs out of memory it writes ``oom-rank{N}.json`` in the
marker folder before exiting non-zero, so the orchestrator can tell an OOM from any other failure.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    from memfit.spec.run import load_run
    from memfit.distributed.ranks import finish, rank_info
    from memfit.io import write_json
    from memfit.train.fallback import _attempt_single, _is_oom

    run = load_run(spec["run_path"])
    try:
        _attempt_single(run, bool(spec["resume"]), (), spec.get("limit"), spec.get("inject_at"))
    except BaseException as err:  # noqa: BLE001
        if not _is_oom(err):
            raise
        rank = rank_info()[0]
        write_json(Path(spec["markers"]) / f"oom-rank{rank}.json",
                   {"rank": rank, "error": f"{type(err).__name__}: {err}"[:300]})
        return 3  # the marker is written: an abort at exit (a peer still in a collective) changes nothing
    finish()  # leave the process group while every rank is alive (gloo aborted at interpreter exit otherwise)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
