"""Fit the estimator's free constants to measurements (plain Python, no torch).

The estimator (``memfit.estimate``) keeps every free constant in one ``Profile`` (plain float fields).
Calibration treats it as a black box: for the chosen fields it builds the Jacobian of the predicted
figures by finite differences and solves the least-squares problem on **relative** residuals
(predicted / measured − 1), with Gauss–Newton iterations and a small Levenberg–Marquardt damping. For
terms linear in a constant (bytes per activation element, fixed overhead bytes, 1 / utilisation) one
iteration lands on the exact fit; the iterations handle mild non-linearity.

Groups are fitted one after another, each against its own measurement (``DEFAULT_PLAN``):

* **logits** constants against the measured logits component (a single, cleanly attributed tensor);
* **memory** constants (activation_scale, checkpoint_extra_layers) against the allocator-level peak
  (``measured.peak_allocated_bytes`` vs the estimate's ``memory.gpu_bytes.total``, without glibc's heap
  holes on the CPU pseudo-device: ``memfit.measure.compare.predicted_memory``) -- not against the
  measured activations component, which under checkpointing misses part of the recomputed working set;
* **time** constants against ``measured.step_seconds`` vs ``time.step_seconds``.

By default the fields fitted are those that move the prediction on the measured set (a field with no
effect cannot be identified). The profile written records, for each fitted field, the remaining
RMS error in percent in ``calibrated``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from memfit.errors import MemfitError

EstimateFn = Callable[[Any, Any], dict]  # (record, profile) -> Estimate.to_dict()


# --------------------------------------------------------------------------- profile access
def profile_fields(profile: Any) -> dict[str, float]:
    """The float fields of a Profile (dataclass or pydantic model)."""
    if dataclasses.is_dataclass(profile):
        items = {f.name: getattr(profile, f.name) for f in dataclasses.fields(profile)}
    elif hasattr(profile, "model_dump"):
        items = profile.model_dump()
    else:
        items = dict(vars(profile))
    return {k: float(v) for k, v in items.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def with_values(profile: Any, values: dict[str, float]) -> Any:
    if dataclasses.is_dataclass(profile):
        return dataclasses.replace(profile, **values)
    if hasattr(profile, "model_copy"):
        return profile.model_copy(update=values)
    new = type(profile)(**{**vars(profile), **values})
    return new


# --------------------------------------------------------------------------- observations
def _get(d: Optional[dict], *path: str) -> Optional[float]:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return float(d) if isinstance(d, (int, float)) else None


def _component(side: str, name: str):
    from memfit.measure.compare import measured_by_component, predicted_memory

    if side == "predicted":
        return lambda est: predicted_memory(est).get(name)
    return lambda meas: measured_by_component((meas or {}).get("components") or {}).get(name) or None


# target -> (predicted figure from an Estimate dict, measured figure from a `measured` object)
TARGETS = {
    "memory": (_component("predicted", "total"), lambda m: _get(m, "peak_allocated_bytes")),
    "time": (lambda e: _get(e, "time", "step_seconds"), lambda m: _get(m, "step_seconds")),
    "activations": (_component("predicted", "activations"), _component("measured", "activations")),
    "logits": (_component("predicted", "logits"), _component("measured", "logits")),
}
TARGET_HELP = {"memory": "measured.peak_allocated_bytes", "time": "measured.step_seconds",
               "activations": "measured activations component", "logits": "measured logits component"}


def _predicted(records: Sequence[dict], profile: Any, estimate_fn: EstimateFn, target: str) -> list[float]:
    out = []
    for r in records:
        v = TARGETS[target][0](estimate_fn(r, profile))
        if v is None:
            raise MemfitError(f"calibrate: the estimate has no figure for {target}")
        out.append(float(v))
    return out


def _measured(records: Sequence[dict], target: str) -> list[Optional[float]]:
    out = []
    for r in records:
        v = TARGETS[target][1](r.get("measured"))
        out.append(float(v) if v else None)
    return out


# --------------------------------------------------------------------------- least squares
def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting for a small square system."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[piv][c]) < 1e-300:
            raise ZeroDivisionError("singular")
        m[c], m[piv] = m[piv], m[c]
        for r in range(n):
            if r != c and m[r][c]:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [m[i][n] / m[i][i] for i in range(n)]


def _residuals(pred: list[float], meas: list[float]) -> list[float]:
    return [p / m - 1.0 for p, m in zip(pred, meas)]


def _rms_pct(res: list[float]) -> float:
    return round(100.0 * math.sqrt(sum(r * r for r in res) / len(res)), 3) if res else 0.0


def fit(records: Sequence[dict], profile: Any, estimate_fn: EstimateFn, *, target: str = "memory",
        fields: Optional[Sequence[str]] = None, iterations: int = 20, damping: float = 1e-9,
        rel_step: float = 1e-4, prior: float = 1e-3) -> tuple[Any, dict[str, Any]]:
    """Fit ``fields`` of ``profile`` so predictions match measurements; (new profile, report).

    ``prior`` adds, per constant, a pseudo-residual ``prior · (x − x₀) / x₀`` that pulls it towards
    its starting value: negligible where the measurements determine a constant, decisive where they
    do not (fewer runs than constants, collinear terms). A positive constant never turns negative.
    """
    recs = [r for r, m in zip(records, _measured(records, target)) if m]
    if not recs:
        raise MemfitError(f"calibrate: no measurement carries the {target} figure "
                          f"({TARGET_HELP[target]})")
    meas = [m for m in _measured(recs, target)]
    values = profile_fields(profile)
    if fields is None:
        fields = sorted(values)
    unknown = [f for f in fields if f not in values]
    if unknown:
        raise MemfitError(f"calibrate: unknown constant(s) {', '.join(unknown)}; the profile has: "
                          + ", ".join(sorted(values)))
    x = {f: values[f] for f in fields}
    res0 = _residuals(_predicted(recs, profile, estimate_fn, target), meas)

    def jacobian(cur: Any, base: list[float]) -> dict[str, list[float]]:
        cols = {}
        for f in list(x):
            h = rel_step * (abs(x[f]) or 1.0)
            pred = _predicted(recs, with_values(cur, {f: x[f] + h}), estimate_fn, target)
            cols[f] = [(p / m - 1.0 - r) / h for p, m, r in zip(pred, meas, base)]
        return cols

    cur = profile
    res = res0
    cols = jacobian(cur, res)
    active = [f for f in x if any(abs(v) > 1e-15 for v in cols[f])]
    dropped = [f for f in x if f not in active]
    x0 = dict(x)
    # a constant's natural size: its value, or (for a zero default) the change that moves predictions 100 %
    scale = {f: abs(x0[f]) or 1.0 / max(max(abs(v) for v in cols[f]), 1e-300) for f in active}

    def penalty(vals: dict[str, float]) -> float:
        return sum((prior * (vals[f] - x0[f]) / scale[f]) ** 2 for f in active)

    def cost(r: list[float], vals: dict[str, float]) -> float:
        return sum(v * v for v in r) + penalty(vals)
    accepted = 0
    for _ in range(10 * iterations if active else 0):
        if accepted >= iterations:
            break
        jtj = [[sum(a * b for a, b in zip(cols[i], cols[j])) for j in active] for i in active]
        for k, f in enumerate(active):
            jtj[k][k] += (prior / scale[f]) ** 2
            jtj[k][k] += damping * (jtj[k][k] or 1.0)
        jtr = [-sum(a * r for a, r in zip(cols[f], res)) - prior ** 2 * (x[f] - x0[f]) / scale[f] ** 2
               for f in active]
        try:
            step = _solve(jtj, jtr)
        except ZeroDivisionError:
            break
        trial_x = {**x, **{f: x[f] + d for f, d in zip(active, step)}}
        flipped = any(x0[f] > 0 >= trial_x[f] for f in active)
        trial = with_values(profile, trial_x)
        trial_res = None if flipped else _residuals(_predicted(recs, trial, estimate_fn, target), meas)
        if flipped or cost(trial_res, trial_x) > cost(res, x) * (1 + 1e-12):
            damping = max(damping, 1e-9) * 10
            if damping > 1e8:
                break
            continue
        improvement = cost(res, x) - cost(trial_res, trial_x)
        x, cur, res = trial_x, trial, trial_res
        accepted += 1
        damping = max(damping / 10, 1e-12)
        if improvement < 1e-18:
            break
        cols = jacobian(cur, res)
    report = {
        "target": target, "n": len(recs), "fitted": {f: x[f] for f in active},
        "before": {f: values[f] for f in active}, "not_identifiable": dropped,
        "rms_error_pct_before": _rms_pct(res0), "rms_error_pct_after": _rms_pct(res),
        "max_error_pct_after": round(100 * max(abs(r) for r in res), 3),
    }
    return cur, report


# The default plan. The logits constants are fitted to the measured logits component: the logits are
# one tensor the profiler attributes cleanly, so the constant keeps its physical meaning. The activation
# constants are fitted to the allocated TOTAL: under checkpointing the profiler files part of the
# recomputed working set as "unattributed" / "gradients", so the measured "activations" component
# understates it and a per-component fit drags checkpoint_extra_layers down (0.78 on the saved grid,
# total max error 3.06 % -> 13.47 %), while the total keeps it ~1.00 (max 3.05 %).
DEFAULT_PLAN: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("logits", ("logits_bytes_16bit", "logits_bytes_fp32")),
    ("memory", ("activation_scale", "checkpoint_extra_layers")),
    ("time", ("gemm_max_fraction", "utilization_fp32", "utilization_cpu")),
)


def calibrate(records: Sequence[dict], profile: Any, estimate_fn: EstimateFn, *,
              memory_fields: Optional[Sequence[str]] = None,
              time_fields: Optional[Sequence[str]] = None,
              plan: Optional[Sequence[tuple[str, Sequence[str]]]] = None) -> tuple[Any, list[dict[str, Any]]]:
    """Fit constants group by group; the profile's ``calibrated`` map gets each fitted field's remaining
    RMS error (%) on its target.

    ``plan`` is a list of (target, fields) with targets from TARGETS. Without it: ``memory_fields``
    against the allocated peak and ``time_fields`` against step time (None = every field; [] = skip).
    Groups whose target no record measured are skipped.
    """
    if plan is None:
        plan = [("memory", memory_fields), ("time", time_fields)]
    reports = []
    calibrated: dict[str, float] = dict(getattr(profile, "calibrated", {}) or {})
    for target, fields in plan:
        if target not in TARGETS:
            raise MemfitError(f"calibrate: unknown target {target!r}; known: {', '.join(TARGETS)}")
        if fields is not None and not fields:
            continue
        if not any(_measured(records, target)):
            continue
        profile, rep = fit(records, profile, estimate_fn, target=target, fields=fields)
        reports.append(rep)
        for f in rep["fitted"]:
            calibrated[f] = rep["rms_error_pct_after"]
    if hasattr(profile, "calibrated"):
        try:
            profile = (dataclasses.replace(profile, calibrated=calibrated) if dataclasses.is_dataclass(profile)
                       else profile.model_copy(update={"calibrated": calibrated}))
        except (TypeError, AttributeError):
            setattr(profile, "calibrated", calibrated)
    return profile, reports


def total_errors(records: Sequence[dict], profile: Any, estimate_fn: EstimateFn) -> list[Optional[float]]:
    """Error % of the predicted total vs the allocated peak, per record, with ``profile``."""
    from memfit.measure.compare import error_pct

    return [error_pct(TARGETS["memory"][0](estimate_fn(r, profile)), _get(r.get("measured"), "peak_allocated_bytes"))
            for r in records]


# --------------------------------------------------------------------------- records on disk
def load_records(runs_dir: Path) -> list[dict]:
    """Every ``*.json`` measurement written by ``memfit measure --out DIR`` (or the bench) in ``runs_dir``."""
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        raise MemfitError(f"--runs {runs_dir}: no such folder; write measurements with "
                          "`memfit measure RUN.yaml --out DIR` first")
    records = []
    for p in sorted(runs_dir.glob("*.json")):
        try:
            data = json.loads(p.read_text())
        except ValueError as err:
            raise MemfitError(f"{p}: not valid JSON ({err}); remove it or re-run the measurement") from None
        items = data if isinstance(data, list) else [data]
        for item in items:
            if isinstance(item, dict) and "measured" in item and "run" in item:
                item.setdefault("_source", str(p))
                records.append(item)
    if not records:
        raise MemfitError(f"--runs {runs_dir}: no measurement files (*.json with 'run' and 'measured')")
    return records


def run_estimate_fn() -> EstimateFn:
    """(record, profile) → the real estimator's dict for the record's run (model/hardware cached)."""
    from memfit.estimate import estimate
    from memfit.resolve import resolve
    from memfit.spec.run import run_from_dict

    cache: dict[int, tuple] = {}

    def fn(record: dict, profile: Any) -> dict:
        key = id(record)
        if key not in cache:
            run = run_from_dict(record["run"], source=record.get("_source", "measurement"))
            cache[key] = resolve(run)
        r = cache[key]
        return estimate(r.model, r.hardware, r.strategy, profile=profile).to_dict()

    return fn


def save_profile(profile: Any, path: Path) -> Path:
    """Write the fitted profile (``Profile.save`` writes atomically)."""
    return Path(profile.save(path))
