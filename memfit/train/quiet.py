"""Silence the training libraries' import chatter and their own progress bars (memfit shows its own).

Call before importing torch / transformers. Errors still surface; only warnings-level noise about
optional kernels (torchao, bitsandbytes, DeepSpeed's accelerator probe) and deprecations is muted.
"""

from __future__ import annotations

import logging
import os
import warnings

_NOISY_LOGGERS = ("torchao", "DeepSpeed", "deepspeed", "bitsandbytes", "torch.utils._pytree",
                  "torch._dynamo", "accelerate", "datasets")


def quiet_libraries() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*register_constant.*")
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"  # DeepSpeed would otherwise warn while probing for a GPU
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
