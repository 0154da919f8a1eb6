"""Which pip extra a command needs, checked before the command imports it.

``pip install memfit`` gives the planner (plan, estimate, matrix); training, measuring and drawing need
extras (pyproject.toml). A command that needs a missing extra raises :class:`MissingExtraError`, which the
CLI prints as one line naming the extra (exit 2), instead of a ``ModuleNotFoundError`` traceback.
Only ``importlib.util.find_spec`` is used: nothing heavy is imported to find out.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Iterable

from memfit.errors import MemfitError

# extra -> (what to call it in the message, the top-level modules it provides)
EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "train": ("training", ("torch", "transformers", "peft", "accelerate", "datasets", "safetensors",
                           "tokenizers")),
    "deepspeed": ("deepspeed", ("deepspeed",)),
    "qlora": ("qlora", ("bitsandbytes",)),
    "plot": ("plot", ("matplotlib",)),
}


class MissingExtraError(MemfitError):
    """A command needs an optional dependency group that is not installed."""


def installed(module: str) -> bool:
    """True where ``module`` can be imported (found on the path; not imported here)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_modules(extra: str) -> list[str]:
    """The modules of ``extra`` that are not installed."""
    return [m for m in EXTRAS[extra][1] if not installed(m)]


def require(command: str, *extras: str) -> None:
    """Raise MissingExtraError naming the first of ``extras`` with a module missing.

    ``command`` is what the user typed after ``memfit`` (``demo``, ``matrix --png``)."""
    for extra in extras:
        if missing_modules(extra):
            what = EXTRAS[extra][0]
            raise MissingExtraError(f"memfit {command} needs the {what} extra: pip install 'memfit[{extra}]'")


def extras_for_run(run: Any) -> list[str]:
    """The extras that training ``run`` imports: train, plus deepspeed for ZeRO, qlora for bitsandbytes."""
    s = run.strategy
    out = ["train"]
    if s.zero_stage:
        out.append("deepspeed")
    if s.method == "qlora" or s.optimizer == "adamw8bit":
        out.append("qlora")
    return out


def require_for_runs(command: str, runs: Iterable[Any]) -> None:
    """``require`` with every extra that any of ``runs`` needs (train first)."""
    needed: list[str] = ["train"]
    for run in runs:
        needed += [e for e in extras_for_run(run) if e not in needed]
    require(command, *needed)
