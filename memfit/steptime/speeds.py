"""What one process achieves on its device: the speeds the time model divides by, and their basis.

Two sources, one shape (:class:`Speeds`):

* **measured** — ``hardware.rates`` (``memfit calibrate --hardware``, memfit.spec.hwprofile) for
  ``local``: GEMM by dtype and width, attention, bandwidth, per-op dispatch, AdamW, collectives, copies,
  NF4 dequantisation, as timed on this machine. On a CPU the figures are read at the threads each
  process runs (``OMP_NUM_THREADS``, else cores / processes as memfit's launcher sets it) and shared
  when processes × threads exceed the cores.
* **catalog** — for a GPU, its kind's rates (memfit.steptime.rates: the parts model prices the micro-batch);
  for an uncalibrated CPU, the core-count guess × ``utilization_cpu``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from memfit.spec.hardware import HardwareSpec
from memfit.steptime.cpu import CPU_FLASH_SHORT, cpu_flash_work
from memfit.steptime.devices import device_kind
from memfit.steptime.rates import GpuRates, gpu_rates
from memfit.steptime.constants import TimeProfile

UNCALIBRATED = "catalog peak x utilisation, uncalibrated"  # an uncalibrated CPU
GPU_PARTS = "catalog GPU, parts model (memfit.steptime), uncalibrated"


def log_interp(pts, x: float) -> float:
    """The value at ``x`` on a curve of measured ``(x, value)`` points sorted by x: log-log interpolation
    between the points around it, the end point's value outside them."""
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            f = math.log(x / x0) / math.log(x1 / x0) if x1 > x0 else 1.0
            return math.exp((1 - f) * math.log(y0) + f * math.log(y1))
    return pts[-1][1]


@dataclass(frozen=True)
class Speeds:
    basis: str
    gemm_small: float  # FLOP/s of a linear (forward + backward) at width ``width_small``
    gemm_large: float  # ... at ``width_large`` (log-width interpolation between, clamped outside)
    width_small: float
    width_large: float
    gemm_skinny: float  # LoRA's rank-r products
    attention: tuple  # ((seq, FLOP/s of 12·b·H·s²·d), ...) for this attention kind, log-interpolated in seq
    bandwidth: float  # bytes/s of memory-bound elementwise work
    op_seconds: float  # dispatch of one small op, forward + backward
    overlap_dispatch: bool  # GPUs: kernels run while the host dispatches (step = max of the two)
    adam_per_param: float  # seconds per parameter of tensors of ``adam_size`` values (large ones)
    adam_per_tensor: float
    cpu_adam_per_param: float  # offloaded optimizer on the host
    bus_bandwidth: float  # collective bus bytes/s between the processes (ring)
    collective_latency: float
    h2d: float
    d2h: float
    dequant: float  # NF4 values dequantised per second
    peak: float  # the floor's FLOP/s (catalog peak of the dtype)
    # measured dispatch, forward + backward, of transformers' code (seconds): per decoder layer, the rest of
    # the model, per PEFT LoRA linear, eager attention's extra per layer; None: counted from op_seconds
    overheads: Optional[tuple] = None  # (layer, model, adapter, eager extra, checkpointing extra per layer or None)
    gemm_mid: tuple = ()  # (width, FLOP/s) measured between small and large, where calibrated
    # SDPA at half the head dim (twice the heads, the same FLOPs), where calibrated (CPU): ((seq, FLOP/s), ...)
    attention_half_d: tuple = ()
    attention_head_dim: float = 0.0  # the head dim of ``attention``'s measurement
    # eager attention in two parts where calibrated (memfit.measure.hwcal.eager_parts): FLOP/s of its batched
    # products, and seconds per score value of the work on the b·H·s² matrix by its bytes (+ forward share)
    eager_bmm: float = 0.0
    eager_bmm_half_d: float = 0.0  # its products at half the head dim, twice the heads (CPU), where calibrated
    eager_head_dim: float = 0.0  # the head dim of ``eager_bmm``'s measurement
    eager_scores: tuple = ()
    eager_scores_forward_share: float = 0.5
    attention_forward_share: float = 1.0 / 3.0  # the forward's share of attention's forward + backward time
    # (recomputed under checkpointing): measured where calibrated (this CPU: SDPA 0.25, eager 0.37-0.53 as its
    # scores grow), else the FLOP share (forward 4·b·H·s²·d of 12)
    dequant_call: float = 0.0  # seconds per Linear4bit forward + input gradient beyond its work (measured)
    first_touch: float = 0.0  # CPU: seconds per byte of a fresh (mmapped) tensor's first touch; 0 = not counted
    dropout_value: float = 0.0  # CPU: seconds per value of a dropout forward (its random draws); 0 = by its bytes
    bus_by_op: tuple = ()  # ((primitive, bus bytes/s), ...) measured besides the all-reduce
    bus_intra: float = 0.0  # bus bytes/s among the GPUs of one node (a group inside a node); 0: bus_bandwidth
    adam_mid: tuple = ()  # (tensor values, seconds per parameter) for cache-sized tensors, where calibrated
    adam_size: float = 0.0  # the tensor size ``adam_per_param`` was measured at
    cpu_flash: bool = False  # SDPA runs torch's CPU flash kernel: its block layout sets the work (cpu_flash_work)
    gpu: Optional[GpuRates] = None  # a catalog GPU: the parts model's speeds (memfit.steptime)

    def bus(self, op: str) -> float:
        """Bus bytes/s of the collective ``op`` (all_reduce | all_gather | reduce_scatter): measured per
        primitive where calibrated (gloo's all-gather and reduce-scatter run ~5x slower per byte than its
        all-reduce), else the all-reduce figure (NCCL's ring primitives share one bus bandwidth)."""
        return dict(self.bus_by_op).get(op, self.bus_bandwidth)

    def adam_seconds_per_param(self, mean_tensor: float) -> float:
        """AdamW per parameter for tensors of ``mean_tensor`` values: log-interpolated between the
        cache-sized and the large calibration tensor (clamped outside)."""
        if not self.adam_mid or self.adam_size <= self.adam_mid[0]:
            return self.adam_per_param
        (s0, r0), (s1, r1) = self.adam_mid, (self.adam_size, self.adam_per_param)
        f = min(1.0, max(0.0, math.log(max(mean_tensor, 1.0) / s0) / math.log(s1 / s0)))
        return r0 + f * (r1 - r0)

    def score_seconds(self, score_bytes: float) -> float:
        """Eager attention's seconds per score value (forward + backward) for a b·H·s² matrix of
        ``score_bytes``: log-interpolated in bytes between the calibrated sizes (clamped outside)."""
        return log_interp(self.eager_scores, score_bytes)

    def attention_rate(self, seq: float, head_dim: float = 0.0) -> float:
        """Attention FLOP/s at sequence length ``seq`` (log-interpolated between the measured lengths) and,
        where the calibration timed SDPA at two head dims, at ``head_dim``: seconds per score = a + b·d
        through the two (the fused kernel's softmax, mask and rescaling per score do not shrink with d:
        at equal FLOPs d = 16 ran 1.11-1.72x as long as d = 32 on this CPU, d = 64 0.65-1.14x; docs/time.md)."""
        rate = self._at_seq(self.attention, seq)
        if not (self.attention_half_d and self.attention_head_dim and head_dim):
            return rate
        return at_head_dim(rate, self._at_seq(self.attention_half_d, seq), self.attention_head_dim, head_dim)

    def _at_seq(self, curve: tuple, seq: float) -> float:
        """A measured (seq, FLOP/s by the s² count) curve at ``seq``. For torch's CPU flash kernel the curve is
        first turned into FLOP/s per computed score (× cpu_flash_work), read among the points on the same side
        of CPU_FLASH_SHORT where there are any, and turned back."""
        if not self.cpu_flash:
            return log_interp(curve, seq)
        per = tuple((x, y * cpu_flash_work(x)) for x, y in curve)
        same = tuple(pt for pt in per if (pt[0] < CPU_FLASH_SHORT) == (seq < CPU_FLASH_SHORT))
        return log_interp(same or per, seq) / cpu_flash_work(seq)

    def eager_bmm_rate(self, head_dim: float = 0.0) -> float:
        """FLOP/s of eager attention's two batched products (q·kᵀ, p·v) at ``head_dim``, where the calibration
        timed them at two head dims: seconds per score = a + b·d, as SDPA's (their outputs, b·H·s² scores
        and b·H·s·d values, do not shrink with d: at equal FLOPs d = 16 ran at 17-30 GFLOP/s on this CPU where
        d = 32 ran at 36-42 and d = 64 at 47-49; docs/time-log.md)."""
        if not (self.eager_bmm_half_d and self.eager_head_dim and head_dim):
            return self.eager_bmm
        return at_head_dim(self.eager_bmm, self.eager_bmm_half_d, self.eager_head_dim, head_dim)

    def gemm(self, k: float, n: float) -> float:
        """FLOP/s of a (tokens × k) · (k × n) linear: skinny below width 64, else log-width interpolation."""
        if min(k, n) <= 64:
            return self.gemm_skinny
        pts = [(self.width_small, self.gemm_small), *([self.gemm_mid] if self.gemm_mid else []),
               (self.width_large, self.gemm_large)]
        return log_interp(pts, math.sqrt(k * n))


def threads_per_process(hw: HardwareSpec) -> int:
    """Threads each CPU process runs: memfit.spec.threads.run_threads, the rule that the processes memfit
    starts are given too (OMP_NUM_THREADS, else torch's count in a training process, else cores // processes)."""
    from memfit.spec.threads import run_threads

    return run_threads(hw.gpus_per_node)


def _interp(table: dict, threads: int) -> Any:
    """A per-thread-count entry at ``threads``: the nearest measured count (numbers interpolate linearly)."""
    keys = sorted(int(k) for k in table if str(k).isdigit())
    if not keys:
        return table.get("device")
    if threads in keys:
        return table[str(threads)]
    lo = max([k for k in keys if k < threads], default=keys[0])
    hi = min([k for k in keys if k > threads], default=keys[-1])
    a, b = table[str(lo)], table[str(hi)]
    if lo == hi or not isinstance(a, (int, float)):
        return table[str(lo if threads - lo <= hi - threads else hi)]
    return a + (b - a) * (threads - lo) / (hi - lo)


def _dtype(precision: str, device: str) -> str:
    if precision == "fp32":
        return "fp32"
    return "fp16" if precision.startswith("fp16") else "bf16"


def measured_speeds(rates: Any, hw: HardwareSpec, precision: str, attention: str, profile: TimeProfile) -> Speeds:
    cpu = rates.device == "cpu"
    threads = threads_per_process(hw) if cpu else 0
    share = min(1.0, rates.cores / float(threads * hw.gpus_per_node)) if cpu else 1.0
    dt = _dtype(precision, rates.device)
    g_all = _interp(rates.gemm, threads) if cpu else rates.gemm["device"]
    coll = (rates.collectives or {}).get(str(hw.world_size))
    # N processes at once on a CPU each run slower than one alone (measured with the collectives)
    conc = (coll or {}).get("concurrency") if cpu and hw.gpus_per_node > 1 else None
    f_gemm, f_ops = (float(conc["gemm"]), float(conc["ops"])) if conc else (1.0, 1.0)
    scale = share / f_gemm
    if dt not in g_all and cpu:  # other dtypes are measured at one thread: fp32's thread gain applies
        one = rates.gemm[str(min(int(k) for k in rates.gemm))]
        if dt in one:
            scale *= g_all["fp32"]["large"] / one["fp32"]["large"]
            g_all = one
    g = g_all.get(dt) or g_all["fp32"]
    a_all = _interp(rates.attention, threads) if cpu else rates.attention["device"]
    a_kind = a_all["eager" if attention == "eager" else "sdpa"]
    att = a_kind.get(dt)
    gain = 1.0
    if att is None:  # not measured in this dtype: fp32's figures x the dtype's GEMM gain
        att = a_kind.get("fp32") or next(v for k, v in a_kind.items())
        gain = g["large"] / g_all["fp32"]["large"] if "fp32" in g_all else 1.0
    curve = tuple(sorted((float(k), float(v) * gain * scale) for k, v in att.items())) if isinstance(att, dict) \
        else ((1.0, float(att) * gain * scale),)
    eager = (a_all.get("eager_parts") or {}).get(dt) if attention == "eager" else None
    half = (a_all.get("sdpa_half_d") or {}).get(dt) if attention != "eager" and cpu else None
    half_curve = tuple(sorted((float(k), float(v) * gain * scale) for k, v in half.items())) if half else ()
    head_dim = float((a_all.get("shape") or [0, 0, 0, 0])[3]) if half_curve else 0.0
    bw = (_interp(rates.bandwidth, threads) if cpu else rates.bandwidth["device"]) * share
    if cpu and hw.gpus_per_node > 1:  # N processes stream through one memory system: each gets its part of the
        busy = min(rates.cores, threads * hw.gpus_per_node)  # bandwidth measured with all their threads running
        bw = min(bw, _interp(rates.bandwidth, busy) / hw.gpus_per_node)
    opt = _interp(rates.optimizer, threads) if cpu else rates.optimizer["device"]
    cat = catalog_speeds(hw, precision, attention, profile)
    cpu_adam = rates.optimizer.get("cpu_deepspeed") or rates.optimizer.get("cpu_torch") or cat.cpu_adam_per_param
    return Speeds(
        basis=rates.basis, gemm_small=g["small"] * scale, gemm_large=g["large"] * scale,
        width_small=g["widths"]["small"], width_large=g["widths"]["large"], gemm_skinny=g["skinny"] * scale,
        attention=curve, bandwidth=bw,
        op_seconds=rates.op_seconds / (share if cpu else 1.0) * f_ops,
        overlap_dispatch=not cpu, adam_per_param=opt["per_param"] / share,
        adam_per_tensor=opt["per_tensor"] / share, cpu_adam_per_param=cpu_adam,
        bus_bandwidth=coll["bus_bytes_per_s"] if coll else cat.bus_bandwidth,
        collective_latency=coll["latency_s"] if coll else cat.collective_latency,
        attention_forward_share=float((a_all.get("forward_share") or {}).get(
            "eager" if attention == "eager" else "sdpa", cat.attention_forward_share)),
        dequant_call=float((rates.dequant or {}).get("nf4_call_s") or 0.0) / (share if cpu else 1.0) * f_ops,
        first_touch=float((rates.bandwidth or {}).get("first_touch_s_per_byte") or 0.0) / share if cpu else 0.0,
        dropout_value=float((rates.bandwidth or {}).get("dropout_s_per_value") or 0.0) / share if cpu else 0.0,
        bus_by_op=tuple((op, float(coll[op]["bus_bytes_per_s"])) for op in ("all_gather", "reduce_scatter")
                        if isinstance((coll or {}).get(op), dict)),
        h2d=(rates.copies or {}).get("h2d") or cat.h2d, d2h=(rates.copies or {}).get("d2h") or cat.d2h,
        dequant=((rates.dequant or {}).get("nf4") or cat.dequant) * (share if cpu else 1.0), peak=cat.peak,
        overheads=_overheads(rates.overheads, (share if cpu else 1.0) / f_ops),
        gemm_mid=(g["widths"]["medium"], g["medium"] * scale) if "medium" in g else (),
        attention_half_d=half_curve, attention_head_dim=head_dim, cpu_flash=cpu and attention != "eager",
        # the cache-sized figure holds for CPU alone: torch's AdamW runs its single-tensor loop there (foreach
        # is CUDA's: torch/optim/optimizer.py _default_to_fused_or_foreach), each tensor's ~10 passes reusing
        # its cached state; on CUDA every foreach kernel sweeps all tensors, and the small calibration tensors
        # read launch time, not bandwidth (H200: 1.6e-10 s/param at 128k values vs 3.5e-11 at 16M)
        adam_mid=(float(opt["mid_tensor_params"]), opt["per_param_mid"] / share) if cpu and opt.get("per_param_mid")
        else (),
        adam_size=float(opt.get("tensor_params", 0.0)),
        eager_bmm=float(eager["bmm"]) * scale if eager else 0.0,
        eager_bmm_half_d=float(eager.get("bmm_half_d") or 0.0) * scale if eager and cpu else 0.0,
        eager_head_dim=float(eager.get("bmm_head_dim") or 0.0) if eager and cpu else 0.0,
        eager_scores=tuple(sorted((float(k), float(v) / scale) for k, v in eager["scores"].items())) if eager else (),
        eager_scores_forward_share=float(eager.get("scores_forward_share", 0.5)) if eager else 0.5)


def at_head_dim(rate: float, rate_half: float, d1: float, head_dim: float) -> float:
    """FLOP/s at ``head_dim`` of an attention kernel measured at head dim ``d1`` (``rate``) and at d1 / 2 with
    twice the heads (``rate_half``: the same FLOPs over twice the scores): seconds per score = a + b·d through
    the two points. A half-d point faster per score than d1's is noise: the measured ``rate`` then stands."""
    d2 = d1 / 2.0
    t1, t2 = 12.0 * d1 / rate, 12.0 * d1 / rate_half  # t2 is per pair of half-width scores: per score t2 / 2
    per_d = (t1 - t2 / 2.0) / (d1 - d2)
    t = t1 + per_d * (head_dim - d1)
    return 12.0 * head_dim / t if t > 0 and per_d >= 0 else rate


def _overheads(o: Any, share: float) -> Optional[tuple[float, ...]]:
    """(layer, model, adapter, eager_layer_extra, gc_layer_extra or None) seconds, shared by the processes."""
    if not o:
        return None
    gc = o.get("gc_layer_extra")
    return (*(float(o[k]) / share for k in ("layer", "model", "adapter", "eager_layer_extra")),
            None if gc is None else float(gc) / share)


def catalog_speeds(hw: HardwareSpec, precision: str, attention: str, profile: TimeProfile) -> Speeds:
    """The uncalibrated speeds: for a CPU, the core-count FLOP/s guess (N processes share the cores); for a
    catalog GPU, its kind's rates (memfit.steptime: the micro-batch is priced from parts there)."""
    p, gpu = profile, hw.gpu
    if gpu.is_cpu:
        peak = gpu.fp32_flops / hw.gpus_per_node
        large = peak * p.utilization_cpu
        bw = p.cpu_bandwidth / hw.gpus_per_node
        op_s, g = p.cpu_op_seconds, None
        att = large / (p.eager_attention_slowdown if attention == "eager" else 1.0)
        adam, cpu_adam = 4 * 8.0 / bw, 1.0 / p.cpu_adam_params_per_second_node
    else:
        g = gpu_rates(gpu, precision, p)
        peak, large = g.peak, g.peak * g.matmul_max
        bw = device_kind(gpu.name).hbm * p.bandwidth_max_fraction
        op_s = g.host_op_seconds
        att = g.peak * (g.package_attention_max if attention == "fa2" else g.attention_max)
        # per fp32 parameter; 16-bit states (pure bf16 full fine-tuning) scale it at use (steptime.loop)
        adam = p.adam_bytes_per_param / (device_kind(gpu.name).hbm * p.adam_bandwidth_fraction)
        cpu_adam = hw.gpus_per_node / p.cpu_adam_params_per_second_node
    if hw.nodes > 1:
        bus = min(hw.inter_node_bandwidth * p.inter_node_efficiency, gpu.intra_node_bandwidth * p.intra_node_efficiency)
    else:
        bus = gpu.intra_node_bandwidth * p.intra_node_efficiency
    if not gpu.is_cpu and not device_kind(gpu.name).p2p:  # no peer-to-peer: NCCL's SHM path through host memory
        bus = min(bus, gpu.pcie_bandwidth * p.shm_bus_fraction)
    pcie = gpu.pcie_bandwidth * p.pcie_efficiency
    intra = gpu.intra_node_bandwidth * p.intra_node_efficiency
    if not gpu.is_cpu and not device_kind(gpu.name).p2p:
        intra = min(intra, gpu.pcie_bandwidth * p.shm_bus_fraction)
    return Speeds(
        basis=GPU_PARTS if g else UNCALIBRATED, gemm_small=large * p.gemm_small_fraction, gemm_large=large,
        width_small=p.gemm_small_width, width_large=p.gemm_large_width,
        gemm_skinny=large * p.gemm_skinny_fraction, attention=((1.0, att),), bandwidth=bw, op_seconds=op_s,
        overlap_dispatch=not gpu.is_cpu, adam_per_param=adam, adam_per_tensor=op_s, cpu_adam_per_param=cpu_adam,
        bus_bandwidth=bus, collective_latency=p.collective_latency_seconds, h2d=pcie, d2h=pcie,
        dequant=bw / 2.5, peak=peak, cpu_flash=gpu.is_cpu and attention != "eager", gpu=g, bus_intra=intra)


def speeds_for(hw: HardwareSpec, precision: str, attention: str, profile: TimeProfile) -> Speeds:
    """Measured speeds for a calibrated 'local' pool of the same device kind, else the catalog's."""
    rates: Optional[Any] = getattr(hw, "rates", None)
    if rates is None:  # the catalog's: by identity first (hashing the Profile's fields costs more than the rest)
        same = _BY_ID.get((id(hw), id(profile), precision, attention))
        if same is not None and same[0] is hw and same[1] is profile:
            return same[2]
    key = (hw, id(rates), precision, attention, profile, threads_per_process(hw) if rates is not None else 0)
    hit = _CACHE.get(key)
    if hit is None or hit[0] is not rates:
        if len(_CACHE) > 1024:
            _CACHE.clear()
        hit = _CACHE[key] = (rates, _speeds(hw, rates, precision, attention, profile))
    if rates is None:
        if len(_BY_ID) > 1024:
            _BY_ID.clear()
        _BY_ID[(id(hw), id(profile), precision, attention)] = (hw, profile, hit[1])  # holds them: ids stay theirs
    return hit[1]


_CACHE: dict = {}
_BY_ID: dict = {}


def _speeds(hw: HardwareSpec, rates: Any, precision: str, attention: str, profile: TimeProfile) -> Speeds:
    if rates is not None and (rates.device == "cpu") == bool(hw.gpu.is_cpu):
        try:
            return measured_speeds(rates, hw, precision, attention, profile)
        except (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError):
            pass  # an incomplete profile: the catalog model, named as such
    return catalog_speeds(hw, precision, attention, profile)
