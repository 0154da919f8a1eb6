"""How a run's strategy becomes arguments for the Hugging Face Trainer's engines (DeepSpeed / FSDP)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memfit.errors import IncompatibleError
from memfit.spec.run import RunSpec


def trainer_engine_kwargs(run: RunSpec, output_dir: Path) -> dict[str, Any]:
    """Extra ``TrainingArguments`` keyword arguments for the run's sharding engine.

    Plain single-process / DDP runs need none. (Stub: DeepSpeed and FSDP come with issue 4.)
    """
    s = run.strategy
    if s.zero_stage or s.fsdp:
        raise IncompatibleError(f"strategy {s.engine} is not supported yet; use zero_stage=0 and fsdp=false")
    return {}
