"""Run several strategies one after another in one process group and record what each rank saw.

``python -m memfit.measure.engine_matrix BASE.yaml CASES.json OUT.json`` (under torchrun, or alone for the
single-process reference). CASES.json is a list of ``{"name": str, "set": [KEY=VALUE, ...],
"resume": bool, "dir": str}``; each case is a ``memfit.train`` run of BASE with those overrides, its
output in ``<output_dir>/<dir or name>`` (a resumed case names the folder of the case it continues).
OUT.json (written by rank 0, atomically, after every case) maps each name to its logged losses, the
saved adapter/model folder and every rank's model-state bytes (:mod:`memfit.measure.rank_state`).

The CI test of the engines (tests/distributed/test_distributed_train.py) and bench/distributed_memory.py use it:
starting Python, torch and the process group once for many runs keeps them within their time budget.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _state_callback():
    from transformers import TrainerCallback

    from memfit.measure.rank_state import rank_state_bytes

    class RankState(TrainerCallback):
        """Model-state bytes of this rank after the newest optimizer step."""

        def __init__(self) -> None:
            self.bytes: dict[str, int] = {}
            self._grads = 0

        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
            if model is not None:  # gradients exist between backward and the optimizer step
                self._grads = rank_state_bytes(model, optimizer)["gradients"]

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
            if model is not None:
                b = rank_state_bytes(model, optimizer)
                b["gradients"] = max(b["gradients"], self._grads)
                b["total"] = b["parameters"] + b["optimizer"] + b["gradients"]
                self.bytes = b

    return RankState()


def _gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _write(obj: Any, path: Path) -> None:
    from memfit.io import write_json

    write_json(path, obj)


def run_case(base: Path, case: dict, world: int) -> dict:
    from memfit.spec.run import load_run
    from memfit.train.api import train

    probe = _state_callback()
    base_run = load_run(base)
    sets = [f"distributed.nproc={world}", *case.get("set", [])]
    folder = Path(base_run.output_dir) / case.get("dir", case["name"])
    run = load_run(base, sets).model_copy(update={"output_dir": str(folder)})
    result = train(run, callbacks=[probe], resume=bool(case.get("resume")))
    return {"losses": [loss for _, loss in result.losses], "steps": result.steps,
            "saved_to": result.saved_to, "engine": run.strategy.engine, "method": run.strategy.method,
            "offload": run.strategy.offload, "ranks": _gather(probe.bytes)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 3:
        print("usage: python -m memfit.measure.engine_matrix BASE.yaml CASES.json OUT.json", file=sys.stderr)
        return 2
    from memfit.train.quiet import quiet_libraries

    quiet_libraries()
    base, cases, out = Path(argv[0]), json.loads(Path(argv[1]).read_text()), Path(argv[2])
    from memfit.distributed.ranks import rank_info

    rank, _, world = rank_info()
    results: dict[str, Any] = {}
    for case in cases:
        results[case["name"]] = run_case(base, case, world)
        if rank == 0:
            _write({"world_size": world, "cases": results}, out)
    from memfit.distributed.ranks import finish

    finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
