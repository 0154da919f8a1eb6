"""``memfit`` entry point. User mistakes (MemfitError, bad flags) print one line and exit 2."""

from __future__ import annotations

import atexit
import gc
import sys
from typing import Optional, Sequence

import typer

from memfit.errors import MemfitError, TrainingInterrupted

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
    from memfit.cli import launch_cmds, measure_cmds, plan_cmds, report_cmds, train_cmds, ui_cmds

    for module in (plan_cmds, train_cmds, launch_cmds, measure_cmds, report_cmds, ui_cmds):
        module.register(app)


_register_commands()


def main(argv: Optional[Sequence[str]] = None) -> None:
    from typer.exceptions import TyperException

    args = list(argv) if argv is not None else sys.argv[1:]
    if argv is None:  # the process ends with the command: skip the final collection of torch's objects
        atexit.register(gc.freeze)  # (a cycle sweep over millions of them: 1-3 s after a torch command)
    try:
        rc = app(args=args, prog_name="memfit", standalone_mode=False)
    except MemfitError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except TrainingInterrupted as err:  # the step, the last checkpoint and how to resume
        print(str(err), file=sys.stderr)
        sys.exit(getattr(err, "exit_code", 130))
    except TyperException as err:  # a bad flag or value: one line, and where the usage is
        if type(err).__name__ == "NoArgsIsHelpError":
            app(args=args, prog_name="memfit")  # prints the help, exits 2
        ctx = getattr(err, "ctx", None)
        cmd = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        msg = err.format_message() if hasattr(err, "format_message") else str(err)
        print(f"error: {' '.join(msg.split())}{cmd}", file=sys.stderr)
        sys.exit(getattr(err, "exit_code", 2))
    except typer.Abort:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    from memfit.methods.peft.count import save_counts

    save_counts()  # PEFT counts made by this command (pricing itself never writes a file)
    if isinstance(rc, int) and rc:
        sys.exit(rc)


if __name__ == "__main__":
    main()
