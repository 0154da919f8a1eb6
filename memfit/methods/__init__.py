"""The fine-tuning methods as a registry: ``METHODS[name]`` is one :class:`~memfit.methods.base.Method`.

Each method lives in its own folder (``memfit/methods/<name>/``) and is listed once below; the strategy
validates ``method`` against this table, the planner's rules and search space, the estimator, the
trainer, ``memfit measure`` and the trace all read it. Importing it imports no torch.
"""

from __future__ import annotations

from memfit.methods.base import Method
from memfit.methods.dora import METHOD as _dora
from memfit.methods.full import METHOD as _full
from memfit.methods.lora import METHOD as _lora
from memfit.methods.meft import METHOD as _meft
from memfit.methods.peft import METHOD as _peft
from memfit.methods.qlora import METHOD as _qlora

METHODS: dict[str, Method] = {m.name: m for m in (_full, _lora, _qlora, _meft, _dora, _peft)}
NAMES: tuple[str, ...] = tuple(METHODS)
PLANNED: tuple[str, ...] = tuple(n for n, m in METHODS.items() if m.planned)


def for_strategy(strategy) -> Method:
    return METHODS[strategy.method]


__all__ = ["METHODS", "Method", "NAMES", "PLANNED", "for_strategy"]
