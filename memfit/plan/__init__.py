"""Planning: which combinations can run (rules), which fit and which is fastest (search), the model ×
context matrix, the GPU-count search, and the files that run a recommendation (emit). Plain Python."""

from memfit.plan.rules import check
from memfit.plan.search import Plan, plan

__all__ = ["check", "plan", "Plan"]
