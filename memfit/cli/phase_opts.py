"""The run-phase options of ``estimate`` and ``plan`` (the run file's ``eval`` and ``save`` keys)."""

from __future__ import annotations

from typing import Any, Optional

import typer
from pydantic import ValidationError

from memfit.errors import ConfigError

R = "Run phases (the run file's eval / save)"
EvalBatchOpt = typer.Option(None, "--eval-batch-size", help="Sequences per GPU per evaluation batch (default: the "
                            "micro-batch, as memfit train).", rich_help_panel=R)
EvalLogitsOpt = typer.Option(False, "--eval-keep-logits", help="Price an evaluation that gathers and keeps every "
                             "batch's logits (a Trainer with compute_metrics); needs --eval-examples. Default: "
                             "loss only, as memfit train.", rich_help_panel=R)
EvalExamplesOpt = typer.Option(None, "--eval-examples", help="Evaluation sequences in all (with "
                               "--eval-keep-logits).", rich_help_panel=R)
SaveModeOpt = typer.Option(None, "--save-mode", help="full | sharded | adapter (default: what memfit train's final "
                           "save does for the engine and method).", rich_help_panel=R)


def run_phases(eval_batch_size: Optional[int], eval_keep_logits: bool, eval_examples: Optional[int],
               save_mode: Optional[str]) -> Any:
    """The RunPhases the flags describe; one line on a bad value."""
    from memfit.spec.phases import RunPhases

    try:
        return RunPhases(eval={"batch_size": eval_batch_size, "loss_only": not eval_keep_logits,
                               "examples": eval_examples}, save={"mode": save_mode})
    except ValidationError as err:
        first = err.errors()[0]
        where = {"batch_size": "--eval-batch-size", "examples": "--eval-examples", "mode": "--save-mode"}.get(
            str(first["loc"][-1]), ".".join(map(str, first["loc"])))
        raise ConfigError(f"{where}: {first['msg']}") from None
