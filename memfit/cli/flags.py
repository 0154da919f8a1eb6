"""The command line's value parsers shared by the plan-side commands (memfit.cli.plan_cmds): lists, patterns,
positive numbers and the --rope-scaling mapping. Each mistake is one ConfigError line naming the flag."""

from __future__ import annotations

from typing import Any, Optional

from memfit.errors import ConfigError


def pattern(text: str, flag: str) -> dict[str, int]:
    """``q_proj=64,down_proj=8`` -> {'q_proj': 64, 'down_proj': 8}."""
    out = {}
    for item in (t.strip() for t in text.split(",") if t.strip()):
        name, _, value = item.partition("=")
        if not name or not value.strip().isdigit() or int(value) < 1:
            raise ConfigError(f"{flag} {text!r}: give module=positive integer pairs, e.g. q_proj=64,down_proj=8")
        out[name.strip()] = int(value)
    if not out:
        raise ConfigError(f"{flag}: give at least one module=value pair, e.g. q_proj=64")
    return out


def int_list(text: Optional[str], flag: str) -> Optional[list[int]]:
    if text is None:
        return None
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: give comma-separated integers, e.g. 256,512,1024") from None
    if not values:
        raise ConfigError(f"{flag}: give at least one value")
    return values


def str_list(text: Optional[str]) -> Optional[list[str]]:
    return None if text is None else [v.strip() for v in text.split(",") if v.strip()]


def positive(name: str, value: int) -> int:
    if value < 1:
        raise ConfigError(f"{name} {value}: must be a positive integer")
    return value


def rope_scaling(text: Optional[str]) -> Optional[dict[str, Any]]:
    """``--rope-scaling '{rope_type: yarn, factor: 4.0}'`` (YAML or JSON) checked as the run file's rope_scaling
    is (memfit.spec.context.check_rope_scaling); None when not given."""
    if text is None:
        return None
    import yaml

    from memfit.spec.context import check_rope_scaling

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or "unreadable"
        raise ConfigError(f"--rope-scaling {text!r}: not YAML / JSON ({problem}); give a mapping such as "
                          "'{rope_type: yarn, factor: 4.0}'") from None
    try:
        return check_rope_scaling(value)
    except ValueError as err:
        raise ConfigError(f"--rope-scaling {text!r}: {err}") from None
