"""Run each configuration in a fresh subprocess and collect what its ranks measured.

A fresh process per configuration means nothing an earlier run allocated (allocator caches, glibc's
free lists, CUDA context) leaks into the next figure. Multi-process runs start under torchrun; every
rank writes ``rank{N}.json`` and the runner merges them (the peak is the largest rank's).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from memfit.errors import ConfigError, MemfitError
from memfit.measure.compare import compare

_STRATEGY_KEYS: Optional[set[str]] = None


def _strategy_keys() -> set[str]:
    global _STRATEGY_KEYS
    if _STRATEGY_KEYS is None:
        from memfit.spec.strategy import Strategy

        _STRATEGY_KEYS = set(Strategy.model_fields)
    return _STRATEGY_KEYS


def sweep_overrides(sweeps: Iterable[str]) -> list[list[str]]:
    """``["gradient_checkpointing=true,false", "seq_len=256,1024"]`` → the cartesian product as
    ``--set`` lists. Bare strategy keys get the ``strategy.`` prefix."""
    axes = []
    for item in sweeps:
        if "=" not in item:
            raise ConfigError(f"--sweep {item!r}: expected KEY=V1,V2,..., e.g. --sweep seq_len=256,1024")
        key, values = item.split("=", 1)
        key = key.strip()
        if "." not in key and key in _strategy_keys():
            key = f"strategy.{key}"
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if not vals:
            raise ConfigError(f"--sweep {key}: no values given; write {key}=V1,V2")
        axes.append([f"{key}={v}" for v in vals])
    return [list(combo) for combo in itertools.product(*axes)] if axes else [[]]


def _root_cause(text: str) -> str:
    """The most telling line of a failed worker's log: the last exception line of a rank, not torchrun's."""
    import re

    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.match(r"^(\[rank\d+\]:\s*)?[\w.]*(Error|Exception|Exceeded)\b.*:", ln) and \
                "ChildFailedError" not in ln:
            return ln[:400]
    return " | ".join(lines[-3:])[:400]


def merge_ranks(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``measured`` object: the peak rank's figures, the slowest step, and every rank listed."""
    if not ranks:
        raise MemfitError("the measured run wrote no figures (did it reach a measured step?)")
    ranks = sorted(ranks, key=lambda r: r.get("rank", 0))
    top = max(ranks, key=lambda r: r["peak_allocated_bytes"])

    def most(key: str) -> Any:
        vals = [r.get(key) for r in ranks if r.get(key) is not None]
        return max(vals) if vals else None

    return {
        "device": top["device"],
        "peak_allocated_bytes": top["peak_allocated_bytes"],
        "peak_reserved_bytes": most("peak_reserved_bytes"),
        "peak_rss_bytes": most("peak_rss_bytes"),
        "cuda_context_bytes": most("cuda_context_bytes"),
        "components": top["components"],
        "step_seconds": most("step_seconds"),
        "step_cpu_seconds": most("step_cpu_seconds"),
        "step_window_seconds": most("step_window_seconds"),
        "timed_window": top.get("timed_window"),
        "method": top.get("method"),
        "ranks": ranks,
        **({"malloc_mmap_threshold": top["malloc_mmap_threshold"]} if "malloc_mmap_threshold" in top else {}),
    }


def run_measured_process(run: Any, *, warmup: int = 1, steps: int = 3, timeout: float = 1800,
                         categories: bool = True, threads: Optional[int] = None,
                         keep_dir: Optional[Path] = None, fork_server: bool = True,
                         baton: Optional[dict] = None) -> dict[str, Any]:
    """Train ``run`` (a RunSpec) for warmup+steps steps in a fresh process; the merged ``measured``.
    ``baton``: step only while holding it (memfit.measure.baton: several runs measured step-interleaved;
    ``Coordinator.gate_spec``), in a new interpreter rather than the fork server (which runs one at a time).

    Single-process runs are forked from a fork server that imported torch/transformers once and has run
    no configuration (a new process each time, without the import cost); ``fork_server=False``, or a
    visible GPU, starts a new interpreter instead. Multi-process runs start under torchrun.

    Every process runs ``threads`` CPU threads, default :func:`memfit.spec.threads.run_threads` (the count
    the prediction reads; never the moment's load average), given as ``OMP_NUM_THREADS`` and in the spec.
    """
    from memfit.spec.threads import ENV, run_threads

    if steps < 1 or warmup < 0:
        raise ConfigError(f"--steps must be >= 1 and --warmup >= 0 (got steps={steps}, warmup={warmup})")
    threads = max(1, int(threads)) if threads else run_threads(run.distributed.nproc)
    work = Path(tempfile.mkdtemp(prefix="memfit-measure-"))
    try:
        spec = {"run": run.model_dump(mode="json"), "warmup": warmup, "steps": steps,
                "out": str(work / "rank{rank}.json"), "categories": categories, "threads": threads, "baton": baton}
        spec["run"]["strategy"]["lora_targets"] = list(run.strategy.lora_targets)
        spec_path = work / "spec.json"
        spec_path.write_text(json.dumps(spec))
        nproc = run.distributed.nproc
        if nproc > 1:
            from memfit.distributed.launch import torchrun_command

            cmd = torchrun_command("memfit.measure.worker", [spec_path], nproc=nproc)
        else:
            cmd = [sys.executable, "-m", "memfit.measure.worker", str(spec_path)]
        from memfit.measure.probe import env_for_measurement

        log = work / "worker.log"
        if nproc == 1 and fork_server and baton is None:
            returncode = _run_forked(spec_path, log, timeout)
        else:
            with open(log, "w") as fh:  # torchrun would give each process 1 thread where none is set
                returncode = subprocess.run(cmd, env={**env_for_measurement(), ENV: str(threads)}, stdout=fh,
                                            stderr=subprocess.STDOUT, timeout=timeout).returncode
        ranks = [json.loads(p.read_text()) for p in sorted(work.glob("rank*.json"))]
        if returncode != 0 and not ranks:
            tail = _root_cause(log.read_text(errors="replace"))
            raise MemfitError(f"measured run {run.strategy.label()} failed (exit {returncode}): {tail}")
        measured = merge_ranks(ranks)
        measured["threads"] = threads  # CPU threads per process (what the prediction was made at)
        if returncode != 0:  # e.g. DeepSpeed's flaky shutdown after training finished
            measured["exit_code"] = returncode
        return measured
    except (subprocess.TimeoutExpired, TimeoutError):
        raise MemfitError(f"measured run {run.strategy.label()} took over {timeout:.0f} s; "
                          "use fewer --steps or a shorter seq_len") from None
    finally:
        if keep_dir is not None:
            shutil.copytree(work, keep_dir, dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)


class _ForkServer:
    """Client of memfit.measure.forkserver (one per parent process, started on first use)."""

    def __init__(self) -> None:
        from memfit.measure.probe import env_for_measurement

        self.proc = subprocess.Popen([sys.executable, "-m", "memfit.measure.forkserver"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env_for_measurement())
        if self._line(600) != "ready":
            raise MemfitError("the measurement fork server did not start")

    def _line(self, timeout: float) -> str:
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError
        return self.proc.stdout.readline().strip()

    def run(self, spec: Path, log: Path, timeout: float) -> int:
        self.proc.stdin.write(f"{spec}\t{log}\n")
        self.proc.stdin.flush()
        pid = int(self._line(60).split()[1])
        try:
            answer = self._line(timeout)
        except TimeoutError:
            os.kill(pid, 9)
            self._line(60)
            raise
        if not answer.startswith("exit "):
            raise MemfitError(f"the measurement fork server answered {answer!r}")
        return int(answer.split()[1])

    def alive(self) -> bool:
        return self.proc.poll() is None


_SERVER: Optional[_ForkServer] = None


def gpu_visible() -> bool:
    """An NVIDIA device node exists (checked without touching CUDA). Forking after CUDA's driver was
    initialised is unsafe, and libraries probe CUDA at import, so GPU machines start fresh interpreters."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return Path("/dev/nvidiactl").exists() or Path("/dev/nvidia0").exists()


def _run_forked(spec_path: Path, log: Path, timeout: float) -> int:
    """A fresh process for ``spec_path``: forked from the fork server on CPU machines, a new interpreter
    where a GPU is visible."""
    global _SERVER
    if gpu_visible():
        from memfit.measure.probe import env_for_measurement
        from memfit.spec.threads import ENV

        threads = json.loads(spec_path.read_text()).get("threads")  # the worker's count (a trace: none)
        env = {**env_for_measurement(), **({ENV: str(threads)} if threads else {})}
        with open(log, "w") as fh:
            return subprocess.run([sys.executable, "-m", "memfit.measure.worker", str(spec_path)],
                                  env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout).returncode
    if _SERVER is None or not _SERVER.alive():
        _SERVER = _ForkServer()
    return _SERVER.run(spec_path, log, timeout)


def run_traced_process(run: Any, *, timeout: float = 900) -> dict[str, Any]:
    """The FakeTensorMode trace of one step of ``run`` (memfit.measure.trace) in a fresh process."""
    from memfit.measure.trace import check_traceable, config_path

    check_traceable(run.strategy)
    config_path(run.model)
    work = Path(tempfile.mkdtemp(prefix="memfit-trace-"))
    try:
        run_dict = run.model_dump(mode="json")
        run_dict["strategy"]["lora_targets"] = list(run.strategy.lora_targets)
        spec_path = work / "spec.json"
        spec_path.write_text(json.dumps({"mode": "trace", "run": run_dict, "out": str(work / "trace.json")}))
        log = work / "worker.log"
        code = _run_forked(spec_path, log, timeout)
        out = work / "trace.json"
        if code != 0 or not out.is_file():
            raise MemfitError(f"traced estimate of {run.strategy.label()} failed: "
                              f"{_root_cause(log.read_text(errors='replace'))}")
        return json.loads(out.read_text())
    except (subprocess.TimeoutExpired, TimeoutError):
        raise MemfitError(f"traced estimate of {run.strategy.label()} took over {timeout:.0f} s") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def predict(run: Any, profile: Any = None) -> dict[str, Any]:
    """The estimator's ``Estimate.to_dict()`` for ``run`` as launched (:func:`memfit.resolve.predict`:
    on this machine's CPU every process of a multi-process run is one pseudo-device)."""
    from memfit.resolve import predict as estimate_run

    return estimate_run(run, profile).to_dict()


def measure(run: Any, *, warmup: int = 1, steps: int = 3, profile: Any = None,
            measured: Optional[dict[str, Any]] = None, traced: bool = False, **kw: Any) -> dict[str, Any]:
    """``{"run", "predicted", "measured", "error_pct", "rows"}`` for one configuration (and
    ``"traced"`` with ``traced=True``: the FakeTensorMode estimate, compared with the same peak)."""
    if traced:  # say what cannot be traced before spending minutes on the real run
        from memfit.measure.trace import check_traceable

        check_traceable(run.strategy)
    from memfit.spec.threads import pinned, run_threads

    # one thread count: decided here (no load average), predicted at and given to the measured processes
    threads = max(1, int(kw.pop("threads", None) or run_threads(run.distributed.nproc)))
    with pinned(threads):
        predicted = predict(run, profile)
    if measured is None:
        measured = run_measured_process(run, warmup=warmup, steps=steps, threads=threads, **kw)
    cmp = compare(predicted or {}, measured)
    trace = None
    if traced:
        from memfit.measure.compare import error_pct

        trace = run_traced_process(run, timeout=kw.get("timeout", 900))
        cmp["error_pct"]["traced_total"] = error_pct(trace["peak_bytes"], measured["peak_allocated_bytes"])
        cmp["rows"].insert(len(cmp["rows"]) - 1, {
            "component": "total (traced step)", "metric": "allocated", "predicted": trace["peak_bytes"],
            "measured": measured["peak_allocated_bytes"], "error_pct": cmp["error_pct"]["traced_total"]})
    run_dict = run.model_dump(mode="json")
    run_dict["strategy"]["lora_targets"] = list(run.strategy.lora_targets)
    return {"label": run.strategy.label(), "run": run_dict, "predicted": predicted, "traced": trace,
            "measured": measured, "error_pct": cmp["error_pct"], "rows": cmp["rows"],
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def save_record(record: dict[str, Any], out_dir: Path, name: str) -> Path:
    """Write one measurement as ``out_dir/name.json`` (atomically) for ``memfit calibrate --runs``."""
    from memfit.io import write_json

    return write_json(Path(out_dir) / f"{name}.json", record, "measurement")


def measure_many(runs: list[Any], on_done: Optional[Callable[[int, dict], None]] = None,
                 **kw: Any) -> list[dict[str, Any]]:
    out = []
    for i, run in enumerate(runs):
        rec = measure(run, **kw)
        out.append(rec)
        if on_done is not None:
            on_done(i, rec)
    return out
