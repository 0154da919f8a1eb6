"""Every data file memfit reads at run time ships in the wheel: pyproject's package-data covers each JSON
under memfit/ (a non-editable install once lost the error bars and PEFT's host-op counts: the patterns
named only memfit/'s own folder)."""

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _glob(rel: str, pattern: str) -> bool:
    """setuptools' glob: a '*' never crosses a '/'."""
    parts, pat = rel.split("/"), pattern.split("/")
    return len(parts) == len(pat) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pat))


def _covered(path: Path, patterns: dict) -> bool:
    package_dir = path.parent
    for key, globs in patterns.items():
        for pkg in ([ROOT / "memfit"] if key == "memfit" else [package_dir] if key == "*" else []):
            rel = path.relative_to(pkg).as_posix() if path.is_relative_to(pkg) else None
            if rel is not None and any(_glob(rel, g) for g in globs):
                return True
    return False


def test_every_json_under_memfit_is_package_data():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    files = sorted((ROOT / "memfit").rglob("*.json"))
    assert {"published_accuracy.json", "published_time_accuracy.json", "host_ops.json"} <= {p.name for p in files}
    missing = [str(p.relative_to(ROOT)) for p in files if not _covered(p, patterns)]
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"
