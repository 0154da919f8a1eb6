"""The run's output folder: which runs may write into it, one at a time, and nothing left by a refusal.

* A folder that holds a finished run (``summary.json``) or checkpoints is refused unless ``--resume``
  (continue it) or ``--overwrite`` (its memfit files are removed before the new run writes any), so a
  folder never mixes two runs' files.
* ``--resume`` of a run that already reached its ``max_steps`` does nothing and says so.
* A lock (``flock`` on ``.memfit.lock``, released by the kernel when the process dies, so a killed run
  never leaves it stuck) makes a second run into the same folder refuse while the first is writing.
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

LOCK_FILE = ".memfit.lock"
SUMMARY_FILE = "summary.json"
# what a memfit run writes into its folder (removed by --overwrite; nothing else is touched)
RUN_FILES = ("summary.json", "metrics.jsonl", "run.yaml", "deepspeed.json", "accelerate.yaml",
             "fallback.json")
RUN_DIRS = ("adapter", "model", "meft", "runs", ".staging")


def check_path(out: Path) -> None:
    """A folder path memfit can use (not a file, not under /proc or /sys)."""
    text = str(out).strip()
    if not text or text == ".":
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


def clear_previous(out: Path) -> None:
    """--overwrite: remove the files an earlier memfit run wrote into ``out`` (only those)."""
    from memfit.train.checkpoint import checkpoints

    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    for p in [*(out / d for d in RUN_DIRS), *checkpoints(out)]:
        if p.is_dir():
            shutil.rmtree(p)


class OutputLock:
    """Hold ``out`` for one run: ``flock`` on ``out/.memfit.lock`` (non-blocking)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.created = False
        self._fd: Optional[int] = None

    def acquire(self) -> "OutputLock":
        import fcntl

        self.created = not self.out.exists()
        make_dir(self.out, "output_dir")
        path = self.out / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as err:
            self.release(refused=True)
            raise write_error(err, self.out, "output_dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            holder = _read_pid(path)
            raise MemfitError(f"output_dir {self.out} is in use by another memfit run"
                              f"{f' (pid {holder})' if holder else ''}; wait for it to finish or use "
                              "another output_dir (--set output_dir=...)") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self, refused: bool = False) -> None:
        """Unlock; after a refusal, a folder this run created and left empty is removed."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if refused and self.created:
            left = [p.name for p in self.out.iterdir()] if self.out.is_dir() else []
            if set(left) <= {LOCK_FILE, ".staging"}:
                shutil.rmtree(self.out, ignore_errors=True)


def _read_pid(path: Path) -> Optional[str]:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None
