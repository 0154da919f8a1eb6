"""The run's output folder: which runs may write into it, one at a time, and nothing left by a refusal.

* A folder that holds a finished run (``summary.json``) or checkpoints is refused unless ``--resume``
  (continue it) or ``--overwrite`` (its memfit files are removed before the new run writes any), so a
  folder never mixes two runs' files.
* ``--resume`` of a run that already reached its ``max_steps`` does nothing and says so.
* A lock (``flock`` on the folder itself: no lock file, and the kernel releases it when the process
  dies, so a killed run never leaves it stuck) makes a second run into the same folder refuse while the
  first is writing.
* A folder this run created is removed again if the run is refused before it trained.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

from memfit.errors import ConfigError, MemfitError
from memfit.io import make_dir, write_error

SUMMARY_FILE = "summary.json"
# what a memfit run writes into its folder (removed by --overwrite; nothing else is touched)
RUN_FILES = ("summary.json", "metrics.jsonl", "run.yaml", "deepspeed.json", "accelerate.yaml",
             "fallback.json", "report.html")
RUN_DIRS = ("adapter", "model", "meft", "runs", ".staging")


def check_path(out: Path) -> None:
    """A folder path memfit can use (not a file, not under /proc or /sys)."""
    text = str(out).strip()
    if not text:
        raise ConfigError("output_dir is empty; give a folder for the run's files, e.g. "
                          "--set output_dir=runs/my-run")
    resolved = out.resolve()
    if resolved.parts[:2] in (("/", "proc"), ("/", "sys"), ("/", "dev")):
        raise ConfigError(f"output_dir {out}: {resolved.parts[1]} is a system folder, not for files; "
                          "give a folder on a disk, e.g. --set output_dir=runs/my-run")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir {out} is a file, not a folder; give a folder path "
                          "(--set output_dir=...)")


def finished_summary(out: Path) -> Optional[dict]:
    p = out / SUMMARY_FILE
    if not p.is_file():
        return None
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def check_reuse(out: Path, run, *, resume: bool, overwrite: bool, has_checkpoints: bool) -> Optional[dict]:
    """Refuse mixing runs. Returns the finished run's summary when ``--resume`` has nothing left to do."""
    if overwrite:
        if resume:
            raise ConfigError("--resume and --overwrite contradict each other: --resume continues the run "
                              f"in {out}, --overwrite replaces it; give one")
        return None
    summary = finished_summary(out)
    if resume:
        check_same_shapes(out, run)
        if summary is not None and run.training.epochs is None and \
                int(summary.get("steps") or 0) >= run.training.max_steps:
            return summary
        return None
    if summary is not None:
        raise MemfitError(f"output_dir {out} holds a finished run ({SUMMARY_FILE}); use another output_dir "
                          "(--set output_dir=...), or --overwrite to replace it")
    if has_checkpoints:
        raise MemfitError(f"output_dir {out} holds checkpoints of an earlier run; continue it with --resume, "
                          "use another output_dir (--set output_dir=...), or --overwrite to replace it")
    return None


# what decides the shapes a checkpoint holds: resuming with another value cannot load it
SHAPE_KEYS = ("method", "lora_r", "lora_targets", "meft_neurons", "meft_experts", "meft_top_k",
              "zero_stage", "fsdp", "optimizer")


def check_same_shapes(out: Path, run) -> None:
    """--resume: the run must build the same trained tensors as the one that wrote the checkpoint."""
    from memfit.spec.run import load_run

    if not (out / "run.yaml").is_file():
        return
    try:
        before = load_run(out / "run.yaml")
    except MemfitError:
        return
    if str(before.model) != str(run.model):
        raise ConfigError(f"--resume: model changed from {before.model} to {run.model} since the checkpoint "
                          f"in {out} was written; resume with {out / 'run.yaml'}, or start anew with "
                          "--overwrite")
    for key in SHAPE_KEYS:
        old, new = getattr(before.strategy, key, None), getattr(run.strategy, key, None)
        if old != new:
            def fmt(v):
                return ",".join(v) if isinstance(v, (tuple, list)) else v
            raise ConfigError(f"--resume: strategy.{key} changed from {fmt(old)} to {fmt(new)} since the "
                              f"checkpoint in {out} was written, so it cannot be loaded; resume with "
                              f"strategy.{key}={fmt(old)}, or start anew with --overwrite")


def clear_previous(out: Path) -> None:
    """--overwrite: remove the files an earlier memfit run wrote into ``out`` (only those)."""
    from memfit.train.checkpoint import checkpoints

    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    for p in [*(out / d for d in RUN_DIRS), *checkpoints(out)]:
        if p.is_dir():
            shutil.rmtree(p)


class OutputLock:
    """Hold ``out`` for one run: a non-blocking ``flock`` on the folder's own descriptor."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.created = False
        self._fd: Optional[int] = None

    def acquire(self) -> "OutputLock":
        import fcntl

        self.created = not self.out.exists()
        make_dir(self.out, "output_dir")
        try:
            fd = os.open(self.out, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError as err:
            self.release(refused=True)
            raise write_error(err, self.out, "output_dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise MemfitError(f"output_dir {self.out} is in use by another memfit run; wait for it to "
                              "finish or use another output_dir (--set output_dir=...)") from None
        self._fd = fd
        return self

    def release(self, refused: bool = False) -> None:
        """Unlock; after a refusal, a folder this run created and left empty is removed."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if refused and self.created:
            left = [p.name for p in self.out.iterdir()] if self.out.is_dir() else []
            if set(left) <= {".staging"}:
                shutil.rmtree(self.out, ignore_errors=True)
