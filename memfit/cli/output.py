"""Shared output helpers for commands: a rich console for people, plain JSON for scripts."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

console = Console()
err_console = Console(stderr=True)


def print_json(obj: Any) -> None:
    """Write ``obj`` as JSON on stdout (nothing else may be printed when --json is given)."""
    sys.stdout.write(json.dumps(obj, indent=2, default=_default) + "\n")


def _default(obj: Any) -> Any:
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def human_bytes(n: float) -> str:
    """Decimal GB/MB, as memfit prints everywhere (GiB only where a line says so)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
