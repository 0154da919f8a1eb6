"""MEFT: a sparse parallel adapter whose parameters and optimizer state live in CPU memory.

Hao et al., "MEFT: Memory-Efficient Fine-Tuning through Sparse Adapter", ACL 2024. A wide adapter
(``neurons`` key-value pairs per layer) sits beside every FFN; per batch only the top-K neurons of each
token (found on the CPU, optionally with a Key-Experts router) are copied to fixed device buffers,
and only their gradients come back and are updated by a lazy CPU AdamW.

    model = add_meft(model, MeftConfig(neurons=8192, top_k=64, experts="auto", n_probe=8))
    opt = build_meft_optimizer(model, lr=1e-3)
    ... loss.backward(); opt.step(); traffic(model) -> {"h2d": bytes, "d2h": bytes, ...}
    save_meft(model, "out/meft"); load_meft(other_model, "out/meft")

Imports torch (and safetensors, lazily); nothing from memfit.train or memfit.measure.
"""

from memfit.meft.config import MeftConfig
from memfit.meft.layer import MeftAdapter, SparseAdapterFn
from memfit.meft.model import (add_meft, adapters, load_meft, meft_state, read_meft_config, reset_traffic,
                               save_meft, traffic)
from memfit.meft.optim import MeftOptimizer, build_meft_optimizer

__all__ = [
    "MeftConfig", "MeftAdapter", "SparseAdapterFn", "MeftOptimizer", "add_meft", "adapters",
    "build_meft_optimizer", "load_meft", "meft_state", "read_meft_config", "reset_traffic", "save_meft",
    "traffic",
]
