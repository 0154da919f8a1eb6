"""``memfit`` entry point. User mistakes (MemfitError, bad flags) print one line and exit 2."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

import click
import typer

from memfit.errors import MemfitError

app = typer.Typer(
    name="memfit",
    help="Make LLM fine-tuning fit the hardware you have, and prove it with measurements.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
def version() -> None:
    """Print memfit's version."""
    from memfit import __version__

    print(__version__)


def _register_commands() -> None:
    # Each module adds its commands; they import heavy libraries (torch) only inside the commands.
    from memfit.cli import plan_cmds, train_cmds, measure_cmds

    for module in (plan_cmds, train_cmds, measure_cmds):
        module.register(app)


_register_commands()


def main(argv: Optional[Sequence[str]] = None) -> None:
    try:
        rv = app(args=list(argv) if argv is not None else None, standalone_mode=False)
    except MemfitError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except click.exceptions.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    except click.exceptions.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
