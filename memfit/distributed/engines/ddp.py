"""Plain data parallel (one process, or torchrun's processes under DDP): the Trainer does it all."""

from memfit.distributed.engines.base import Engine


class Ddp(Engine):
    name = "ddp"
