"""The CUDA caching allocator's mode the strategy chose (``strategy.allocator``), set before CUDA allocates.

torch reads ``PYTORCH_CUDA_ALLOC_CONF`` when its CUDA allocator first configures itself
(``c10/cuda/CUDAAllocatorConfig``); the setting ``expandable_segments:True`` may also change at run time (the
allocator's Note [Expandable Segments]: "Expandable blocks can be enabled/disabled throughout the run"), which
``torch.cuda.memory._set_allocator_settings`` does once CUDA is initialised. On the CPU nothing is set.
"""

from __future__ import annotations

import os
from typing import Optional

ENV = "PYTORCH_CUDA_ALLOC_CONF"
SETTING = "expandable_segments:True"


def merged_conf(current: str) -> str:
    """``current`` (the user's own settings kept) with expandable segments on."""
    parts = [p for p in (x.strip() for x in current.split(",")) if p and not p.startswith("expandable_segments")]
    return ",".join(parts + [SETTING])


def apply_allocator(strategy, cuda: Optional[bool] = None) -> Optional[str]:
    """Set the allocator's mode for ``strategy`` on CUDA; the summary's note, or None when nothing was set."""
    if strategy.allocator != "expandable_segments":
        return None
    import torch

    cuda = torch.cuda.is_available() if cuda is None else cuda
    if not cuda:
        return None
    os.environ[ENV] = merged_conf(os.environ.get(ENV, ""))
    if torch.cuda.is_initialized():  # already configured: change it in place
        torch.cuda.memory._set_allocator_settings(SETTING)
    return f"allocator: {ENV}={os.environ[ENV]} (strategy.allocator=expandable_segments)"
