"""What a catalog GPU kind can do, beyond its data-sheet peaks (memfit.spec.hardware.CATALOG): the speeds the
GPU time model's parts divide by, each from a public source.

* ``sms`` — streaming multiprocessors (NVIDIA data sheets / architecture white papers): a GEMM's or a fused
  attention kernel's thread blocks run in waves of this many (tile and wave quantisation, NVIDIA's "Matrix
  Multiplication Background" guide §3.1-3.2).
* ``hbm`` — memory bandwidth, bytes/s (data sheets).
* ``matmul_max`` — the best achievable fraction of the dense 16-bit peak for a large bf16 GEMM ("maximum
  achievable matmul FLOPS", stas00/ml-engineering compute/accelerator/README.md: A100 SXM 271 of 312 = 0.87,
  H100 SXM 794 of 989 = 0.80; XLA's measured H100 table reads 783 at 4096³). Kinds without a published
  figure take the Profile's ``gemm_max_fraction``.
* ``attention_max`` — FlashAttention-2's forward + backward FLOP/s at long sequences as a fraction of the
  peak (FA2 paper arXiv 2307.08691: up to ~230 TFLOP/s = 0.6-0.73 of A100's 312 forward, ~0.55-0.6 forward +
  backward; FA3 paper arXiv 2407.08608: FA2 reaches only ~0.35-0.4 of H100's). Ampere / Ada / others take
  the Profile's ``attention_max_fraction``. That is SDPA's kernel; on Hopper torch 2.13's SDPA runs cuDNN's
  attention, and ``flash_attn_package_max`` is the flash-attn 2 package's (``attention: fa2``): FA3 paper Figs.
  5-6, forward 335 and backward 322 TFLOP/s of H100's 989 at 16k, head dim 128.
* ``p2p`` — whether the cards of one node exchange over NVLink or PCIe peer-to-peer. GeForce cards without an
  NVLink bridge have none (RTX 4090: disabled in the driver; RTX 3090: "CANNOT Access Peer", NVIDIA/nccl#1127):
  NCCL falls back to its SHM transport through host memory, at ``Profile.shm_bus_fraction`` of the PCIe link
  (memfit.steptime.speeds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from memfit.spec import gpus

GB = 1e9


@dataclass(frozen=True)
class DeviceKind:
    name: str
    sms: int
    hbm: float  # bytes/s
    arch: str  # volta | turing | ampere | ada | hopper
    matmul_max: Optional[float] = None  # published best achievable bf16 GEMM / peak; None: the Profile's
    attention_max: Optional[float] = None  # FA2 fwd+bwd / peak at long sequences; None: the Profile's
    p2p: bool = True
    fused_attention: bool = True  # FlashAttention-2 kernels (sm80+); older parts run SDPA's mem-efficient one
    flash_attn_package_max: Optional[float] = None  # the flash-attn 2 package (attention: fa2) where torch's SDPA
    #                                      runs another kernel (Hopper: cuDNN's); None: the same as attention_max


def _devices() -> dict[str, DeviceKind]:
    """Every kind's speeds from its record (memfit/spec/gpus/<name>.json, sources inside)."""
    return {r["name"]: DeviceKind(r["name"], r["sms"], r["hbm_gbs"] * GB, r["arch"], r.get("matmul_max"),
                                  r.get("attention_max"), r.get("p2p", True), r.get("fused_attention", True),
                                  r.get("flash_attn_package_max"))
            for r in gpus.records()}


DEVICES: dict[str, DeviceKind] = _devices()

DEFAULT = DeviceKind("unknown", 108, 1000 * GB, "ampere")


def device_kind(name: str) -> DeviceKind:
    """The kind of a catalog GPU (a custom-memory variant ``A100-80GB`` named otherwise falls back by its
    prefix), else a generic Ampere-class part."""
    if name in DEVICES:
        return DEVICES[name]
    for key, kind in DEVICES.items():
        if name.startswith(key.split("-")[0] + "-"):
            return kind
    return DEFAULT
