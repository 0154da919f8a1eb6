"""Every result file memfit writes goes through here.

A file or folder is written whole or not at all (a temporary name next to it, then one rename), gets the
permissions the user's umask gives an ordinary file or folder (0644 / 0755 under umask 022, never
``mkstemp``'s 0600 / 0700), and an operating-system failure (disk full, read-only file system, no
permission, a file where a folder belongs) becomes one :class:`WriteError` line naming the path, with
nothing half-written left behind.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from memfit.errors import MemfitError

_REASONS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.EISDIR: "it is a folder",
    errno.EEXIST: "a file is in the way",
    errno.ENOENT: "no such file or folder",
    errno.ENAMETOOLONG: "the name is too long",
}


class WriteError(MemfitError):
    """memfit could not write a result (the message says which path and why)."""


def reason(err: OSError) -> str:
    """A short, plain reason for an OS error ("no space left on device")."""
    return _REASONS.get(err.errno, err.strerror or type(err).__name__)


def write_error(err: OSError, path: Any, what: str = "") -> WriteError:
    where = f"{what} {path}" if what else str(path)
    return WriteError(f"cannot write {where}: {reason(err)}")


def umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    return 0o666 & ~umask()


def dir_mode() -> int:
    return 0o777 & ~umask()


def make_dir(path: Any, what: str = "folder") -> Path:
    """``mkdir -p`` with a WriteError line instead of an OSError traceback."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise WriteError(f"cannot write {what} {path}: it is a file, not a folder; give a folder path")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise write_error(err, path, what) from None
    return path


@contextmanager
def atomic_file(path: Any, what: str = "") -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it becomes ``path`` (umask permissions), on
    error it is removed. For writers that want a file name (safetensors, matplotlib)."""
    path = Path(path)
    make_dir(path.parent)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise write_error(err, path, what) from None
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException as err:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(err, OSError):
            raise write_error(err, path, what) from None
        raise


def write_text(path: Any, text: str, what: str = "") -> Path:
    with atomic_file(path, what) as tmp:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
    return Path(path)


def write_bytes(path: Any, data: bytes, what: str = "") -> Path:
    with atomic_file(path, what) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    return Path(path)


def write_json(path: Any, obj: Any, what: str = "", **dumps: Any) -> Path:
    dumps.setdefault("indent", 2)
    return write_text(path, json.dumps(obj, **dumps) + "\n", what)


def fix_modes(root: Any) -> None:
    """Give ``root`` and everything under it umask permissions (mkdtemp makes 0700)."""
    fmode, dmode = file_mode(), dir_mode()
    os.chmod(root, dmode)
    for base, dirs, files in os.walk(root):
        for d in dirs:
            os.chmod(os.path.join(base, d), dmode)
        for f in files:
            os.chmod(os.path.join(base, f), fmode)


def replace_dir(src: Path, dst: Path) -> None:
    """Move a finished folder into place; an existing ``dst`` is swapped out first, then removed."""
    src, dst = Path(src), Path(dst)
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_dir(dst: Any, what: str = "") -> Iterator[Path]:
    """Yield a temporary folder next to ``dst``; on success it becomes ``dst`` (umask permissions
    throughout), on error it is removed and an OSError becomes a WriteError line."""
    dst = Path(dst)
    make_dir(dst.parent)
    try:
        tmp = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.tmp-"))
    except OSError as err:
        raise write_error(err, dst, what) from None
    try:
        yield tmp
        fix_modes(tmp)
        replace_dir(tmp, dst)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError):
            raise write_error(err, dst, what) from None
        raise


def read_json_or_empty(path: Any) -> dict:
    """A shipped JSON data file as a dict; {} when it is missing or unreadable (the caller then reports
    that it has no data)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
