"""The estimator: memory per GPU, CPU RAM per node and step time of a fine-tuning run (plain Python).

    from memfit.estimate import estimate
    est = estimate(resolve_model("llama-2-7b"), parse_hardware("8xA100-80GB"), Strategy(method="full", zero_stage=3))
    est.gpu_total, est.step_seconds, est.fits, est.to_dict()
"""

from memfit.estimate.constants import DEFAULT_PROFILE, Profile
from memfit.estimate.estimate import estimate, meft_traffic_bytes
from memfit.estimate.result import Estimate
from memfit.estimate.memory import state_bytes

__all__ = ["Estimate", "estimate", "meft_traffic_bytes", "Profile", "DEFAULT_PROFILE", "state_bytes"]
