"""One catalog GPU's speeds for the time model's parts (:class:`GpuRates`), from its kind
(memfit.steptime.devices), its data-sheet peaks (memfit.spec.hardware) and the Profile's free constants."""

from __future__ import annotations

from dataclasses import dataclass

from memfit.steptime.devices import device_kind


@dataclass(frozen=True, eq=False)  # hashed by identity: one object per (GPU, Profile) from speeds_for's cache
class GpuRates:
    name: str
    sms: int
    peak: float  # FLOP/s of the compute dtype (dense 16-bit tensor cores, or plain fp32)
    fp32_peak: float  # plain fp32 FLOP/s (fp32 adapters without autocast run there; TF32 is off by default)
    matmul_max: float  # best achievable share of ``peak`` for a large GEMM
    gemm_kernel_seconds: float  # a GEMM's fixed device time (launch latency, ramp, tail)
    small_tile_efficiency: float  # a 64 x 128 tile's rate against a 128 x 128 one
    hbm: float  # bytes/s
    bandwidth_max: float  # achieved share of ``hbm`` by large elementwise kernels
    bandwidth_half_bytes: float  # transfer size at which an elementwise kernel reaches half of that
    attention_max: float  # fused attention, forward + backward, share of ``peak`` at long sequences
    attention_half_seq: float  # sequence length at which it reaches half of that
    package_attention_max: float  # the same for the flash-attn 2 package (attention: fa2), where it differs
    fused_attention: bool  # FlashAttention-2 kernels (sm80+); else SDPA's memory-efficient kernel
    host_op_seconds: float  # host: PyTorch eager dispatch + launch of one module-level op, forward + backward

    def bandwidth(self, size: float) -> float:
        """Achieved bytes/s of an elementwise kernel moving ``size`` bytes: latency-bound when small, reaching
        ``bandwidth_max`` of the HBM when large (Calculon's A100 table: >= 100 MB 0.90, >= 10 MB 0.75,
        >= 1 MB 0.60, below 0.30; a saturating curve through it with its half point at 2 MB)."""
        size = max(size, 1.0)
        return self.hbm * self.bandwidth_max * size / (size + self.bandwidth_half_bytes)


def gpu_rates(gpu, precision: str, profile) -> GpuRates:
    kind = device_kind(gpu.name)
    fp32 = precision == "fp32"
    peak = gpu.fp32_flops if fp32 else gpu.peak_flops
    # a published best-achievable figure is a hot GEMM of ideal shape; inside a training step GEMMs sustain
    # matmul_sustained_fraction of it (clocks at the power limit, HBM shared with the kernels beside them)
    published = kind.matmul_max * profile.matmul_sustained_fraction if kind.matmul_max else None
    matmul_max = profile.utilization_fp32 if fp32 else (published or profile.gemm_max_fraction)
    attention = (kind.attention_max or profile.attention_max_fraction) * (0.5 if fp32 else 1.0)
    return GpuRates(
        name=gpu.name, sms=kind.sms, peak=peak, fp32_peak=gpu.fp32_flops, matmul_max=matmul_max,
        gemm_kernel_seconds=profile.gemm_kernel_seconds, small_tile_efficiency=profile.gemm_small_tile_efficiency,
        hbm=kind.hbm, bandwidth_max=profile.bandwidth_max_fraction,
        bandwidth_half_bytes=profile.bandwidth_half_bytes,
        attention_max=attention, attention_half_seq=profile.attention_half_seq,
        package_attention_max=kind.flash_attn_package_max or attention, fused_attention=kind.fused_attention,
        host_op_seconds=profile.gpu_host_op_seconds)
