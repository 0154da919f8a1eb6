"""Training on transformers + peft: ``train(run) -> TrainResult`` and the embedded demo assets.

Importing this package is cheap; torch and transformers load when ``train`` is first used.
"""

from __future__ import annotations

from typing import Any

__all__ = ["train", "TrainResult"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from memfit.train import api

        return getattr(api, name)
    raise AttributeError(name)
