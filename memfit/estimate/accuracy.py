"""The estimator's measured error on published GPU runs, by kind of run (data written by
``bench/gpu_published.py --write-accuracy``; plain JSON beside this module, read once). Each run is predicted
with the fitted allocator constants refitted without its source group (leave-one-group-out); each range
carries its ``basis``, computed by the bench from bench/provenance.json: ``held_out`` only where nothing was
decided after seeing those rows, else ``development``; the in-sample ranges (the Profile's defaults, fitted on
every group) ride along. ``bench/gpu_published.py --check`` (run by the tests) fails when the file is stale."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Optional

from memfit.io import read_json_or_empty
from memfit.spec.strategy import LONG_CONTEXT_LEVERS
from memfit.steptime.accuracy import basis_text, noise_text, readings_text

DATA = Path(__file__).resolve().parent / "published_accuracy.json"
LONG_CONTEXT = Path(__file__).resolve().parent / "long_context_accuracy.json"  # bench/long_context.py --json


def run_kind(method: str, zero_stage: int, fsdp, offload: str, world: int) -> str:
    """e.g. 'qlora, 1 GPU', 'lora, ZeRO-3', 'full, FSDP + offload'."""
    if fsdp:
        engine = "FSDP"
    elif zero_stage:
        engine = "ZeRO-3" if zero_stage == 3 else "ZeRO-1/2"
    else:
        engine = "1 GPU" if world == 1 else "DDP"
    return f"{method}, {engine}" + (" + offload" if offload != "none" else "")


@lru_cache(maxsize=1)
def _data() -> dict:
    return read_json_or_empty(DATA)


def _table() -> dict:
    return _data().get("kinds", {})


def published_error(kind: str) -> Optional[dict]:
    """{'kind', 'figures', 'rows', 'min_pct', 'max_pct', 'median_abs_pct', 'basis', 'hand_set', 'rests_on',
    'date', 'in_sample': {...}, 'noise_floor', 'oom_called_fitting', 'ran_called_not_fitting', 'source', ...} or
    None when no published run of this kind could be expressed. The top-level range is the leave-one-group-out
    one; ``basis`` says whether it is held out or a development figure."""
    hit = _table().get(kind)
    if hit is None:
        return None
    data = _data()
    return {"kind": kind, **hit, "procedure": data.get("procedure"), "noise_floor": data.get("noise_floor"),
            "held_out_readings": data.get("held_out_readings", []), "date": data.get("date"),
            "basis_rows": data.get("rows"), "source": "bench/gpu_published.py", "command": data.get("command")}


@lru_cache(maxsize=1)
def _long_context() -> dict:
    return read_json_or_empty(LONG_CONTEXT)


def long_context_error(strategy) -> Optional[dict]:
    """The published long-context runs' figures (bench/long_context.py) for an estimate that pulls a
    long-context lever (None otherwise): what memfit's levers were checked against, and how closely."""
    if all(getattr(strategy, key, off) == off for key, off in LONG_CONTEXT_LEVERS):
        return None
    return _long_context() or None


def describe_long_context(err: dict) -> str:
    """One line: the long-context figures, their basis and the command that prints them."""
    mem, longest, step = err.get("memory") or {}, err.get("longest") or {}, err.get("s_per_step") or {}
    basis = err.get("basis") or {}
    return (f"published long-context runs ({basis.get('memory', '?')}): memory median |e| "
            f"{mem.get('median_abs_pct')} % over {mem.get('compared')} figures, longest fitting length "
            f"{longest.get('median_abs_pct')} % over {longest.get('compared')}, s/step {step.get('median_abs_pct')} % "
            f"over {step.get('compared')} (`{err.get('command')}`; docs/long-context.md)")


def describe(err: Optional[dict]) -> str:
    if not err:
        return "no measured GPU run of this kind to check against yet"
    basis = basis_text(err) + noise_text(err)
    oom, ran = err.get("oom_called_fitting") or 0, err.get("ran_called_not_fitting") or 0
    wrong = "" if not (oom or ran) else (
        f"; wrong fit verdict on {oom + ran} of {err.get('verdicts', '?')} runs ({oom} out of memory called fitting, "
        f"{ran} that ran called not fitting)")
    return (f"{err['kind']}: within {err['min_pct']:+.1f}…{err['max_pct']:+.1f} % on {err['figures']} measured GPU "
            f"figure{'s' if err['figures'] != 1 else ''} ({basis}; published runs + memfit's GPU check"
            + (f", {err['date']}" if err.get("date") else "") + ")" + wrong + readings_text(err))
