"""Typed descriptions shared by plan, train and measure (plain Python: no torch)."""

from memfit.spec.strategy import Strategy
from memfit.spec.run import RunSpec, load_run, run_from_dict

__all__ = ["Strategy", "RunSpec", "load_run", "run_from_dict"]
