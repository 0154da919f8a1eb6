"""This machine's measured speeds (the hardware profile), read as plain JSON: no torch.

``memfit calibrate --hardware`` (``memfit.measure.hwcal``) times what a training step spends its time on
and writes one JSON file per machine fingerprint under the user cache dir
(``$MEMFIT_CACHE``, else ``$XDG_CACHE_HOME/memfit``, else ``~/.cache/memfit``). ``parse_hardware("local")``
attaches the cached file's rates to the pool; the time model (``memfit.steptime.step``) uses them and
names the basis of every time figure. A corrupt file, one of another machine or another schema is
ignored with a one-line note.

Units: FLOP/s, bytes/s, seconds. CPU figures are per thread count (``"1"`` and ``str(cores)``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

SCHEMA = "memfit-hardware-profile/2"  # /2: CPU GEMM shapes at 1024 rows, eager by score bytes, GC dispatch


def cache_dir() -> Path:
    """``$MEMFIT_CACHE`` (as the demo uses it), else ``$XDG_CACHE_HOME/memfit``, else ``~/.cache/memfit``."""
    root = os.environ.get("MEMFIT_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "memfit" if xdg else Path(os.path.expanduser("~")) / ".cache" / "memfit"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _package_version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # not installed: the fingerprint says so
        return "none"


def machine_facts(gpu_names: list[str]) -> dict[str, Any]:
    """What makes timings of this machine differ from another's (no torch import); ``gpu_names`` as
    nvidia-smi lists the visible devices (memfit.spec.hardware.detect_local)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"machine": platform.machine(), "cpu": _cpu_model(), "cores": cores, "gpus": list(gpu_names),
            "torch": _package_version("torch"), "schema": SCHEMA}


def fingerprint(facts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def profile_path(fp: str) -> Path:
    return cache_dir() / f"hardware-{fp}.json"


@dataclass(frozen=True)
class HardwareRates:
    """Measured speeds of one device of this machine (see memfit.measure.hwcal for how each is timed)."""

    device: str  # "cpu" | "cuda"
    measured_at: str  # ISO date of the calibration
    cores: int
    gemm: dict  # threads ("1", "N") or "device" -> dtype -> shape class (large | small | skinny) -> FLOP/s
    attention: dict  # threads -> "eager"|"sdpa" -> dtype -> FLOP/s of 12·b·H·s²·d (forward + backward)
    bandwidth: dict  # threads -> bytes/s of memory-bound elementwise work (read + written)
    op_seconds: float  # one small autograd op, forward + backward (dispatch overhead)
    optimizer: dict  # "torch_adamw" / "deepspeed_cpu_adam" -> seconds per parameter (threads -> s)
    copies: dict = field(default_factory=dict)  # "h2d" / "d2h" pinned bytes/s (CUDA only)
    collectives: dict = field(default_factory=dict)  # str(world) -> {"backend", "bus_bytes_per_s", "latency_s"}
    dequant: dict = field(default_factory=dict)  # "nf4" -> dequantised elements/s (bitsandbytes)
    overheads: dict = field(default_factory=dict)  # seconds of dispatch, forward + backward, of transformers'
    # Llama code at nil widths: "layer" (per decoder layer), "model" (embedding, mask, norm, head, loss),
    # "adapter" (per PEFT LoRA linear), "eager_layer_extra"
    fingerprint: str = ""
    took_seconds: float = 0.0
    # the last calibrations' own figures (newest last); the fields above are the per-figure median of those
    # measured within WINDOW_SECONDS of the newest
    history: list = field(default_factory=list)
    measured_unix: float = 0.0  # when it was measured (seconds since the epoch; 0: not recorded)

    @property
    def basis(self) -> str:
        n = len(recent(self.history))
        return f"measured on this machine {self.measured_at}" + (f", median of {n} calibrations" if n > 1 else "")

    def threads_key(self, threads: int) -> str:
        keys = sorted((int(k) for k in self.gemm if k.isdigit()), key=int)
        if not keys:
            return "device"
        return str(min(keys, key=lambda k: (abs(k - threads), -k)))

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {"schema": SCHEMA, **asdict(self)}

    @classmethod
    def from_dict(cls, raw: Any) -> "HardwareRates":
        if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} file")
        names = ("device", "measured_at", "cores", "gemm", "attention", "bandwidth", "op_seconds", "optimizer")
        missing = [n for n in names if n not in raw]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        kw = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        rates = cls(**kw)
        if not isinstance(rates.gemm, dict) or not rates.gemm or not isinstance(rates.bandwidth, dict):
            raise ValueError("gemm/bandwidth are not tables")
        float(rates.op_seconds)
        return rates


def load_cached(fp: str, path: Optional[Path] = None) -> tuple[Optional[HardwareRates], Optional[str]]:
    """(rates, note): the cached profile of the machine ``fp``, or None and why it was ignored (no note
    when there is no file)."""
    path = Path(path) if path is not None else profile_path(fp)
    if not path.is_file():
        return None, None
    try:
        rates = HardwareRates.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError) as err:
        return None, (f"ignoring the hardware profile {path} ({str(err)[:80] or type(err).__name__}); "
                      "times use catalog peaks until `memfit calibrate --hardware --force` re-measures")
    if rates.fingerprint != fp:
        return None, (f"ignoring the hardware profile {path}: it was measured on another machine "
                      f"(fingerprint {rates.fingerprint or '?'} != {fp}); run `memfit calibrate --hardware --force`")
    return rates, None


def save(rates: HardwareRates, path: Optional[Path] = None) -> Path:
    """Write atomically with the usual permissions (temp file in the same folder + os.replace)."""
    path = Path(path) if path is not None else profile_path(rates.fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(rates.to_dict(), indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


MEASURED = ("gemm", "attention", "bandwidth", "op_seconds", "optimizer", "copies", "collectives", "dequant",
            "overheads")
KEEP = 5  # calibrations kept in the profile's history
# only calibrations within this many seconds of the newest enter the median: a shared machine's speed moves
# by +-20-30 % within minutes (what the median smooths) but also by up to 2x between phases lasting hours
# (the small-op cost here read 26 us one evening and 11 us the next night; docs/time-log.md)
WINDOW_SECONDS = 2 * 3600.0


def recent(history: list) -> list:
    """The kept calibrations within WINDOW_SECONDS of the newest (all of them when none records a time)."""
    if not history:
        return []
    newest = float(history[-1].get("measured_unix") or 0.0)
    return [h for h in history if float(h.get("measured_unix") or 0.0) >= newest - WINDOW_SECONDS]


# figures merged by their mean: how much slower N processes run side by side (collectives' "concurrency") is
# a two-state mixture on a shared host: 1.0x, or ~1.9x for seconds at a time while the host runs both vCPUs
# on one core (1 calibration in 8 caught it in each of the grid runs tg21 and tg22; docs/time-log.md). A run
# lasting minutes meets the mixture's mean; the median of a few calibrations reads 1.0 and misses it.
MEAN_FIGURES = ("concurrency",)


def median_of(values: list, mean: bool = False) -> Any:
    """The per-figure median of several measurements of one table (nested dicts of numbers; the mean under
    a key of MEAN_FIGURES); a figure that some lack is merged from those that have it; anything not a
    number is the newest's."""
    if all(isinstance(v, dict) for v in values):
        keys = [k for v in values for k in v]
        return {k: median_of([v[k] for v in values if k in v], mean or k in MEAN_FIGURES)
                for k in dict.fromkeys(keys)}
    nums = sorted(v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool))
    if nums and len(nums) == len(values):
        if mean:
            return sum(nums) / len(nums)
        mid = len(nums) // 2
        return nums[mid] if len(nums) % 2 else (nums[mid - 1] + nums[mid]) / 2.0
    return values[-1]


def median_figures(history: list) -> dict[str, Any]:
    """Every measured table of the calibrations in ``history``, as their per-figure median."""
    return {k: median_of([h[k] for h in history if k in h]) for k in MEASURED}


def with_history(new: HardwareRates, previous: Optional[HardwareRates]) -> HardwareRates:
    """``new`` merged with the calibrations kept in ``previous`` (same machine and schema): the figures are
    the median of the last ``KEEP`` measured within ``WINDOW_SECONDS`` of ``new``. On a shared machine one
    calibration's speeds move by ±20-30 % with its neighbours for tens of seconds at a time; the median of
    several, taken at different times, is what a run lasting minutes meets (docs/time.md)."""
    from dataclasses import asdict, replace

    own = {k: asdict(new)[k] for k in MEASURED} | {"measured_at": new.measured_at, "took_seconds": new.took_seconds,
                                                   "measured_unix": new.measured_unix}
    kept = list(previous.history) if previous is not None and previous.history else (
        [{k: asdict(previous)[k] for k in MEASURED} | {"measured_unix": previous.measured_unix}]
        if previous is not None else [])
    history = (kept + [own])[-KEEP:]
    merged = median_figures(recent(history))
    return replace(new, history=history, **merged)
