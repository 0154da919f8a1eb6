"""CLI commands for multi-process / multi-node launch (registered by memfit.cli.app)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this module's commands to `app`."""
