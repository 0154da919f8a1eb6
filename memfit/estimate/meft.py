"""MEFT in the estimate: the geometry lives once, in memfit.methods.meft.memory (the method registry);
this module keeps the public ``meft_traffic_bytes`` with the default Profile."""

from __future__ import annotations

from typing import Optional

from memfit.estimate.constants import DEFAULT_PROFILE, Profile
from memfit.methods.meft import memory as _geometry
from memfit.spec.model import ModelSpec
from memfit.spec.strategy import Strategy


def meft_traffic_bytes(model: ModelSpec, strategy: Strategy, profile: Optional[Profile] = None) -> dict[str, float]:
    """MEFT bytes per process per optimizer step (see memfit.methods.meft.memory.meft_traffic_bytes)."""
    return _geometry.meft_traffic_bytes(model, strategy, profile or DEFAULT_PROFILE)
