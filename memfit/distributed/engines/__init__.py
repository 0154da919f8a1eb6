"""The engines as a registry: one object per way of running a step across processes.

``engine = engines.for_run(run)`` (or ``for_strategy(strategy)``) gives the run's engine; the trainer
calls it (see :mod:`memfit.distributed.engines.base` for the order) and ``plan --emit`` / ``memfit launch``
ask it for the files it reads. The table is keyed by ``Strategy.engine``.
"""

from __future__ import annotations

from memfit.distributed.engines.base import Engine
from memfit.distributed.engines.ddp import Ddp
from memfit.distributed.engines.deepspeed import DeepSpeed
from memfit.distributed.engines.fsdp import Fsdp

ENGINES: dict[str, Engine] = {
    "ddp": Ddp(),
    "zero1": DeepSpeed(1),
    "zero2": DeepSpeed(2),
    "zero3": DeepSpeed(3),
    "fsdp-full_shard": Fsdp("full_shard"),
    "fsdp-shard_grad_op": Fsdp("shard_grad_op"),
    "fsdp1-full_shard": Fsdp("full_shard", version=1),
    "fsdp1-shard_grad_op": Fsdp("shard_grad_op", version=1),
}


def for_strategy(strategy) -> Engine:
    return ENGINES[strategy.engine]


def for_run(run) -> Engine:
    return for_strategy(run.strategy)


__all__ = ["ENGINES", "Engine", "for_run", "for_strategy"]
