"""``memfit train --fallback``: on out-of-memory, continue from the last checkpoint with the next plan.

An attempt ends on a CUDA out-of-memory error (``torch.OutOfMemoryError``) or on the configured memory
cap (:class:`MemoryLimitExceeded`, checked by :class:`MemoryGuard` after every micro-step against the
process's peak RSS). The attempt is recorded in ``OUTPUT/fallback.json``, memory is freed, and the run
continues from the newest complete checkpoint with the next strategy:

1. gradient checkpointing on;
2. SDPA instead of eager attention;
3. half the micro-batch, twice the accumulation (the effective batch stays the same);
4. (several processes) a higher ZeRO stage, or FSDP ``full_shard`` instead of ``shard_grad_op``;
5. (sharded runs) offload the optimizer, then the parameters.

The candidates are ordered as the planner ranks them (fastest predicted step first among those
predicted lighter than the plan that failed, then the rest, lightest first); where the model cannot be
read as a spec, in the order above.
Multi-process runs (DeepSpeed / FSDP) run each attempt under torchrun through
``memfit.train.fallback_worker``, whose ranks write an ``oom-rank{N}.json`` marker when they run out.
"""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from memfit.errors import MemfitError

FALLBACK_LOG = "fallback.json"
MARKER_DIR = ".fallback"
INJECT_ENV = "MEMFIT_INJECT_OOM_AT_STEP"   # drills/tests: raise an OOM at this step of the first attempt
LIMIT_ENV = "MEMFIT_MEMORY_LIMIT"          # a CPU memory cap, e.g. "6GB" (peak RSS)


class MemoryLimitExceeded(RuntimeError):
    """The configured memory cap was crossed (treated like an out-of-memory error by --fallback)."""


def memory_guard(limit: Optional[int], inject_at: Optional[int]):
    """A TrainerCallback: raise :class:`MemoryLimitExceeded` when the peak RSS crosses ``limit`` (after
    every micro-step), and an injected ``torch.OutOfMemoryError`` at step ``inject_at`` (drills, tests)."""
    import torch
    from transformers import TrainerCallback

    from memfit.train.callbacks import peak_rss_bytes

    class MemoryGuard(TrainerCallback):
        def _check(self, state: Any) -> None:
            if limit is not None and peak_rss_bytes() > limit:
                raise MemoryLimitExceeded(f"peak RSS {peak_rss_bytes() / 1e9:.3f} GB crossed the memory limit "
                                          f"{limit / 1e9:.3f} GB at step {state.global_step + 1}")

        def on_step_begin(self, args, state, control, **kw):
            if inject_at is not None and state.global_step + 1 == inject_at:
                raise torch.OutOfMemoryError(f"injected out-of-memory at step {inject_at} (test drill)")

        def on_substep_end(self, args, state, control, **kw):
            self._check(state)

        def on_step_end(self, args, state, control, **kw):
            self._check(state)

    return MemoryGuard()


# --------------------------------------------------------------------------- the ladder
def _with(strategy: Any, **update: Any) -> Optional[Any]:
    from pydantic import ValidationError

    from memfit.spec.strategy import Strategy

    try:
        return Strategy.model_validate({**strategy.model_dump(), **update})
    except ValidationError:
        return None


def ladder(run: Any) -> list[tuple[str, Any]]:
    """(what changes, new Strategy) for every single lighter step from ``run.strategy``."""
    s = run.strategy
    world = run.distributed.nproc * run.distributed.nodes
    out: list[tuple[str, Any]] = []
    if not s.gradient_checkpointing:
        out.append(("gradient checkpointing on", _with(s, gradient_checkpointing=True)))
    if s.attention == "eager":
        out.append(("SDPA attention instead of eager", _with(s, attention="sdpa")))
    if s.micro_batch_size > 1:
        mb = s.micro_batch_size // 2 if s.micro_batch_size % 2 == 0 else 1
        ga = s.grad_accum * s.micro_batch_size // mb
        out.append((f"micro-batch {s.micro_batch_size}→{mb}, grad_accum {s.grad_accum}→{ga}",
                    _with(s, micro_batch_size=mb, grad_accum=ga)))
    if world > 1:
        if s.fsdp == "shard_grad_op":
            out.append(("FSDP full_shard", _with(s, fsdp="full_shard")))
        elif not s.fsdp and s.zero_stage < 3:
            out.append((f"ZeRO stage {s.zero_stage}→{s.zero_stage + 1}", _with(s, zero_stage=s.zero_stage + 1)))
    if s.zero_stage or s.fsdp:
        if s.offload == "none":
            out.append(("offload optimizer to CPU", _with(s, offload="optimizer")))
        elif s.offload == "optimizer" and (s.zero_stage == 3 or s.fsdp == "full_shard"):
            out.append(("offload optimizer and parameters", _with(s, offload="optimizer+params")))
    return [(why, st) for why, st in out if st is not None]


def _ranked(run: Any, options: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The planner's order: lighter than the failed plan (fastest first), then the rest (lightest first).
    A model the estimator cannot read (a ConfigError) keeps the fixed order; estimator bugs propagate."""
    from memfit.estimate import estimate
    from memfit.resolve import resolve

    try:
        r = resolve(run)
    except MemfitError:
        return options
    now = estimate(r.model, r.hardware, r.strategy).to_dict()["memory"]["gpu_bytes"]["total"]
    lighter, others = [], []
    for i, (why, st) in enumerate(options):
        d = estimate(r.model, r.hardware, st).to_dict()
        mem, secs = d["memory"]["gpu_bytes"]["total"], d["time"]["step_seconds"]
        if mem < now:
            lighter.append((secs, i, why, st))
        else:  # the estimate says it will not help; the estimate can be wrong: try it last
            others.append((mem, i, why, st))
    return [(why, st) for _, _, why, st in sorted(lighter) + sorted(others)]


def next_plan(run: Any) -> Optional[tuple[str, Any]]:
    """The next lighter strategy after ``run`` failed, or None when the ladder is exhausted."""
    from memfit.plan.rules import check
    from memfit.resolve import resolve
    from memfit.spec.run import run_from_dict

    options = _ranked(run, ladder(run))
    try:
        r = resolve(run)
    except MemfitError:
        r = None
    if r is not None:
        options = [(why, st) for why, st in options if not check(r.model, r.hardware, st)]
    if not options:
        return None
    why, st = options[0]
    raw = run.model_dump(mode="json")
    raw["strategy"] = st.model_dump(mode="json")
    return why, run_from_dict(raw, source="fallback")


# --------------------------------------------------------------------------- attempts
def _is_oom(err: BaseException) -> bool:
    import torch

    if isinstance(err, (torch.OutOfMemoryError, MemoryLimitExceeded)):
        return True
    return isinstance(err, RuntimeError) and "out of memory" in str(err).lower()


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _latest_step(out: Path) -> Optional[tuple[int, str]]:
    from memfit.train.checkpoint import checkpoints

    found = checkpoints(out)
    if not found:
        return None
    return int(found[-1].name.split("-")[-1]), str(found[-1])


def _write_log(out: Path, log: dict[str, Any]) -> None:
    from memfit.io import write_json

    write_json(out / FALLBACK_LOG, log, "fallback log")


def _attempt_single(run: Any, resume: bool, callbacks: Sequence, limit: Optional[int],
                    inject_at: Optional[int]):
    from memfit.train.api import train

    return train(run, callbacks=[*callbacks, memory_guard(limit, inject_at)], resume=resume)


RANK_ERROR = ("Error", "error:", "terminate called", "what():", "Exception", "Killed")


def _rank_error(stderr: str) -> str:
    """What a failed torchrun attempt says: the ranks' own last error lines (torchrun's closing summary
    names only the signal, e.g. 'Signal 6 (SIGABRT) received by PID ...') and that summary's last line."""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    own = [ln for ln in lines if any(k in ln for k in RANK_ERROR) and "ChildFailedError" not in ln
           and "error_file" not in ln]
    picked = own[-2:] + [ln for ln in lines[-3:] if "Signal" in ln or "exitcode" in ln][-1:]
    return " | ".join(dict.fromkeys(picked or lines[-3:]))


def _attempt_multi(run: Any, resume: bool, limit: Optional[int], inject_at: Optional[int], out: Path):
    """One attempt under torchrun; returns None on success, or the error text of an OOM'd rank."""
    import subprocess

    from memfit.distributed.launch import STOP_CODES, launch_env, run_torchrun, torchrun_command
    from memfit.errors import TrainingInterrupted
    from memfit.spec.run import save_run

    markers = out / MARKER_DIR
    markers.mkdir(parents=True, exist_ok=True)
    for p in markers.glob("oom-rank*.json"):
        p.unlink()
    run_path = save_run(run, markers / "attempt-run.yaml")
    spec = {"run_path": str(run_path), "resume": resume, "limit": limit, "inject_at": inject_at,
            "markers": str(markers)}
    (markers / "attempt.json").write_text(json.dumps(spec))
    cmd = torchrun_command("memfit.train.fallback_worker", [markers / "attempt.json"], nproc=run.distributed.nproc)
    stderr: list[str] = []  # torchrun in a session of its own; a SIGINT / SIGTERM reaches it once and every
    code = run_torchrun(cmd, launch_env(nproc=run.distributed.nproc), stderr.append, None,  # worker ends
                        stdout=subprocess.DEVNULL)
    stop = {c: name for name, c in STOP_CODES.items()}.get(code)
    if stop is not None:
        raise TrainingInterrupted(f"stopped ({stop}): every process of this attempt ended; {out} keeps its newest "
                                  "complete checkpoint: continue with the same command and --resume", exit_code=code)
    ooms = [json.loads(p.read_text()) for p in sorted(markers.glob("oom-rank*.json"))]
    if ooms:
        return "; ".join(f"rank {o['rank']}: {o['error']}" for o in ooms)
    if code != 0:
        raise MemfitError(f"training failed (exit {code}), not for lack of memory: {_rank_error(''.join(stderr))}")
    return None


def train_with_fallback(run: Any, *, run_path: Optional[str] = None, overrides: Sequence[str] = (),
                        resume: bool = False, callbacks: Sequence = (), max_attempts: int = 6,
                        memory_limit: Optional[int] = None, inject_oom_at: Optional[int] = None):
    """Train ``run``; on out-of-memory continue with the next plan. Returns the final TrainResult
    (for multi-process runs: the rank-0 summary dict), with every attempt logged in fallback.json."""
    out = Path(run.output_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    if memory_limit is None and os.environ.get(LIMIT_ENV):
        from memfit.spec.hardware import parse_size  # 6GB, 512MB, 8GiB

        memory_limit = parse_size(os.environ[LIMIT_ENV], LIMIT_ENV)
    if inject_oom_at is None and os.environ.get(INJECT_ENV):
        inject_oom_at = int(os.environ[INJECT_ENV])
    log: dict[str, Any] = {"run_file": run_path, "overrides": list(overrides), "memory_limit": memory_limit,
                           "attempts": []}
    current, resume_now = run, resume
    multi = run.distributed.nproc * run.distributed.nodes > 1
    for attempt in range(1, max_attempts + 1):
        entry: dict[str, Any] = {"attempt": attempt, "strategy": current.strategy.label(),
                                 "levers": current.strategy.model_dump(mode="json"),
                                 "resumed_from": (_latest_step(out) or (None, None))[1] if resume_now else None,
                                 "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        log["attempts"].append(entry)
        _write_log(out, log)
        inject = inject_oom_at if attempt == 1 else None
        error: Optional[str] = None
        result = None
        if multi:
            error = _attempt_multi(current, resume_now, memory_limit, inject, out)
        else:
            try:
                result = _attempt_single(current, resume_now, callbacks, memory_limit, inject)
            except BaseException as err:  # noqa: BLE001 - only OOMs are handled, the rest re-raised
                if not _is_oom(err):
                    raise
                error = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
                err.__traceback__ = None  # drop the frames that hold the model and optimizer
                del err
        if error is None:
            entry["outcome"] = "finished"
            _write_log(out, log)
            if result is None:  # multi-process: the rank-0 summary
                summary = out / "summary.json"
                result = json.loads(summary.read_text()) if summary.is_file() else {"output_dir": str(out)}
            _attach(result, log)
            return result
        free_memory()
        last = _latest_step(out)
        entry.update(outcome="out of memory", error=error, last_checkpoint=last[1] if last else None)
        nxt = next_plan(current)
        if nxt is None:
            _write_log(out, log)
            raise MemfitError(f"out of memory with {current.strategy.label()} and no lighter plan is left "
                              f"(tried {attempt}); see {out / FALLBACK_LOG} and `memfit plan` for bigger "
                              "hardware")
        why, current = nxt
        entry["next"] = why
        resume_now = last is not None
        _write_log(out, log)
    raise MemfitError(f"out of memory {max_attempts} times; giving up (see {out / FALLBACK_LOG})")


def _attach(result: Any, log: dict[str, Any]) -> None:
    n = len(log["attempts"])
    if n == 1:
        return
    note = (f"--fallback: {n - 1} out-of-memory attempt(s); finished with "
            f"{log['attempts'][-1]['strategy']} (" + "; ".join(a.get("next", "") for a in log["attempts"][:-1])
            + ")")
    if isinstance(result, dict):
        result.setdefault("notes", []).append(note)
        result["fallback"] = log
    elif hasattr(result, "notes"):
        result.notes.append(note)
