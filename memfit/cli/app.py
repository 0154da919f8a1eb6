"""``memfit`` entry point. User mistakes (MemfitError, bad flags) print one line and exit 2."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

import typer

from memfit.errors import MemfitError

app = typer.Typer(
    name="memfit",
    help="Make LLM fine-tuning fit the hardware you have, and prove it with measurements.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Make LLM fine-tuning fit the hardware you have, and prove it with measurements."""


@app.command()
def version() -> None:
    """Print memfit's version."""
    from memfit import __version__

    print(__version__)


def _register_commands() -> None:
    # Each module adds its commands; they import heavy libraries (torch) only inside the commands.
    from memfit.cli import launch_cmds, measure_cmds, plan_cmds, train_cmds

    for module in (plan_cmds, train_cmds, launch_cmds, measure_cmds):
        module.register(app)


_register_commands()


def main(argv: Optional[Sequence[str]] = None) -> None:
    try:
        # standalone mode: typer prints usage errors itself and exits 2.
        app(args=list(argv) if argv is not None else None)
    except MemfitError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as err:  # TrainingInterrupted says the step, checkpoint and how to resume
        print(str(err) or "interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
