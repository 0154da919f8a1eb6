"""The page's numbers, from the planner's own library functions with ``memfit plan``'s arguments.

:func:`run_plan` is ``memfit plan``: the same loading (memfit.ui.form.load), the same call of
memfit.plan.search.plan, and ``Plan.to_dict()`` is what ``memfit plan --json`` prints. :func:`emit_files`
is ``plan --emit`` (memfit.distributed.emit.emit). The matrix and the GPU-count search are
memfit.plan.matrix.matrix and memfit.plan.gpu_count.gpu_count_search for the chosen pool.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from memfit.errors import ConfigError, IncompatibleError
from memfit.ui.form import Form, gb_text, command_line, load, plan_kwargs


def plan_json(obj: Any) -> str:
    """JSON text as ``memfit plan --json`` writes it (indent 2; objects through to_dict/model_dump)."""

    def default(o: Any) -> Any:
        if hasattr(o, "to_dict"):
            return o.to_dict()
        if hasattr(o, "model_dump"):
            return o.model_dump(mode="json")
        if isinstance(o, (set, frozenset, tuple)):
            return list(o)
        raise TypeError(f"not JSON serialisable: {type(o).__name__}")

    return json.dumps(obj, indent=2, default=default)


@dataclass
class PlanResult:
    """One answer of the page: the inputs as read, the plan, and how long the planner took."""

    form: Form
    ref: str
    model: Any
    hardware: Any
    plan: Any
    command: Optional[str]
    seconds: float
    files: list = field(default_factory=list)

    @property
    def custom(self) -> bool:
        return gb_text(self.form.custom_gb, "custom memory per GPU") is not None

    def to_dict(self) -> dict:
        """Exactly ``memfit plan --json``'s object for the same inputs."""
        return self.plan.to_dict()


def run_plan(form: Form, workdir: Path) -> PlanResult:
    """Plan as ``memfit plan`` does; a user mistake raises a MemfitError (one line)."""
    from memfit.plan.search import plan

    started = time.perf_counter()
    kwargs = plan_kwargs(form)
    ref, spec, hw = load(form, workdir)
    result = plan(spec, hw, profile=None, **kwargs)
    if not result.candidates and all(r.kind == "rule" for r in result.rejected):
        raise IncompatibleError("no combination can run here: " + result.rejected[0].reasons[0])
    return PlanResult(form, ref, spec, hw, result, command_line(form, ref), time.perf_counter() - started)


def _folder(result: PlanResult, workdir: Path) -> Path:
    """One folder per distinct question (model, pool, CPU RAM, search arguments): asked again, its files
    are already there."""
    key = json.dumps([result.ref, str(result.model), result.hardware.text(), gb_text(result.form.cpu_ram_gb,
                      "CPU RAM"), plan_kwargs(result.form)], sort_keys=True, default=str)
    return workdir / f"emit-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def emit_files(result: PlanResult, workdir: Path, d: Optional[dict] = None) -> list[Path]:
    """run.yaml + the engine's files as ``memfit plan --emit`` writes them, the full plan as plan.json and
    the command line as command.txt; [] when nothing fits or the card's memory is custom (no catalog pool
    to write). ``d``: ``result.to_dict()`` when the caller has it."""
    from memfit.distributed.emit import emit
    from memfit.io import write_text

    rec = result.plan.recommended
    if rec is None or result.custom:
        return []
    out = _folder(result, workdir)
    done = out / "files.json"  # written last: the folder is complete
    if done.is_file():
        return [Path(p) for p in json.loads(done.read_text(encoding="utf-8"))]
    written = emit(out, rec.strategy, model_ref=result.ref, hardware=result.hardware,
                   cpu_ram=gb_text(result.form.cpu_ram_gb, "CPU RAM"))
    written.append(write_text(out / "plan.json", plan_json(d if d is not None else result.to_dict()) + "\n"))
    if result.command:
        written.append(write_text(out / "command.txt", result.command + "\n"))
    write_text(done, json.dumps([str(p) for p in written]))
    return written


def matrix_for(form: Form) -> Any:
    """``memfit matrix`` for the chosen pool (its default models, lengths and the study's levers)."""
    from memfit.plan.matrix import matrix
    from memfit.spec.hardware import parse_hardware
    from memfit.ui.form import pool_text

    hw = parse_hardware(pool_text(form), cpu_ram=gb_text(form.cpu_ram_gb, "CPU RAM"))
    return matrix(hw, margin=plan_kwargs(form)["margin"])


def gpu_counts(form: Form, workdir: Path, max_gpus: int = 8, price: Optional[float] = None,
               tokens: Optional[int] = None) -> Any:
    """``memfit plan --gpu KIND --max-gpus N``: the chosen model on 1..N GPUs of the chosen kind."""
    from memfit.plan.gpu_count import gpu_count_search
    from memfit.spec.model import resolve_model
    from memfit.ui.form import model_ref

    if price is not None and price < 0:
        raise ConfigError(f"GPU-hour price {price:g}: must be 0 or more")
    spec = resolve_model(model_ref(form, workdir))
    from memfit.spec.context import refusal

    if refusal(spec, plan_kwargs(form)["seq_len"]):  # as `memfit plan --gpu`: refused once, not at every count
        raise IncompatibleError(refusal(spec, plan_kwargs(form)["seq_len"]))
    return gpu_count_search(spec, form.gpu, max_gpus=max_gpus, cpu_ram=gb_text(form.cpu_ram_gb, "CPU RAM"),
                            price=price, tokens=tokens, **plan_kwargs(form))
