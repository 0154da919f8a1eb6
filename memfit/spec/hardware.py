"""GPU catalog and hardware pools: ``8xV100-32GB``, ``2x8xA100-80GB``, ``RTX4090-24GB``, ``local``.

Plain Python (no torch). Units: bytes and bytes/s (decimal), FLOP/s. A catalog GPU's memory is what CUDA
lets a process use: ``cudaMemGetInfo``'s total (``torch.cuda.get_device_properties().total_memory``, the
"total capacity" of an out-of-memory message), not the marketing size: the driver keeps 0.3-1.3 GiB, and ECC
on a GDDR6 part takes ~1/16 (an L40S's 48 GB reads 44.4 GiB) — ``CUDA_TOTAL_GIB`` cites each figure.
Bandwidths are one direction, as a collective sees them.
``peak_flops`` is the dense 16-bit tensor-core rate (bf16, or fp16 on parts without bf16) from the
vendor data sheets; ``fp32_flops`` the plain fp32 (non-tensor) rate.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from memfit.errors import ConfigError
from memfit.spec import gpus

GiB = 1 << 30
GB = 10**9


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int
    bf16: bool
    fa2: bool
    peak_flops: float  # dense 16-bit tensor FLOP/s
    fp32_flops: float
    intra_node_bandwidth: float  # bytes/s per GPU, one direction (NVLink, or PCIe peer-to-peer)
    pcie_bandwidth: float  # bytes/s host<->device, one direction
    is_cpu: bool = False
    pcie_link: str = ""  # the host link the user stated ('pcie3x8', pool suffix '@pcie3x8'); '' = the catalog's


def _catalog() -> tuple[dict[str, tuple[float, str]], dict[str, GpuSpec]]:
    """CUDA's total per catalog part in GiB with its source (the "total capacity" of PyTorch out-of-memory
    messages whose thread names the card, the lowest figure cited, or measured here), and the catalog: one
    record per kind in memfit/spec/gpus/ (data-sheet peaks, dense; links one direction)."""
    totals, catalog = {}, {}
    for r in gpus.records():
        if r["catalog"]:
            totals[r["name"]] = (r["cuda_total_gib"], r["cuda_total_source"])
            catalog[r["name"]] = GpuSpec(r["name"], int(r["cuda_total_gib"] * GiB), r["bf16"], r["fa2"],
                                         r["dense_16bit_tflops"] * 1e12, r["fp32_tflops"] * 1e12,
                                         r["intra_node_gbs"] * GB, r["pcie_gbs"] * GB)
    return totals, catalog


CUDA_TOTAL_GIB, CATALOG = _catalog()

DEFAULT_INTER_NODE_BANDWIDTH = 12.5 * GB  # 100 Gb/s InfiniBand / RoCE per node, one direction
CPU_FLOPS_PER_CORE = 64e9  # fp32 peak per core, order of magnitude: 2 FMA units x 8–16 lanes x 2 FLOP x 2–3 GHz
# (a 2048² fp32 matmul ran at ~44 GFLOP/s per core on this project's shared CI-like machine)


@dataclass(frozen=True)
class HardwareSpec:
    """A pool: ``nodes`` × ``gpus_per_node`` identical devices; ``cpu_ram_bytes`` is per node."""

    gpu: GpuSpec
    gpus_per_node: int = 1
    nodes: int = 1
    cpu_ram_bytes: int = 64 * GiB
    inter_node_bandwidth: float = DEFAULT_INTER_NODE_BANDWIDTH
    cpu_ram_given: bool = False
    label: str = ""
    # this machine's measured speeds (memfit.spec.hwprofile.HardwareRates) for 'local', when calibrated;
    # rates_note: why a cached profile was ignored (one line, for the CLI to show)
    rates: Optional[Any] = field(default=None, compare=False)
    rates_note: str = field(default="", compare=False)

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def describe(self) -> str:
        pool = f"{self.gpus_per_node}x{self.gpu.name}" + (f"@{self.gpu.pcie_link}" if self.gpu.pcie_link else "")
        return f"{self.nodes}x{pool}" if self.nodes > 1 else pool

    def text(self) -> str:
        """The pool as a user writes it: '8xV100-32GB', '2x8xV100-32GB', '2xRTX3090-24GB@pcie3x8' or 'local'."""
        return "local" if self.label == "local" else self.describe()

    def with_nodes(self, n: int) -> "HardwareSpec":
        """The same pool with ``n`` nodes (each node keeps its GPUs and CPU RAM)."""
        return replace(self, nodes=n, label="")

    def with_gpus_per_node(self, k: int) -> "HardwareSpec":
        """The same GPU kind, ``k`` per node; CPU RAM follows the catalog default unless the user gave it."""
        ram = self.cpu_ram_bytes if self.cpu_ram_given else default_cpu_ram(self.gpu, k)
        return replace(self, gpus_per_node=k, cpu_ram_bytes=ram, label="")


_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}


def parse_size(text: str | int | float, what: str = "size") -> int:
    """``'128GB'`` → 128e9 bytes (decimal), ``'64GiB'`` → 64·2³⁰, ``'512MB'``, plain numbers are bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise ConfigError(f"{what}: {text} is negative; give a size such as 128GB or 64GiB")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ConfigError(
            f"{what}: cannot read {text!r}; write a number with a unit such as 128GB, 64GiB, 512MB"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def _norm(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name).upper().replace("NVIDIA", "").replace("GEFORCE", "").replace("RTXA", "A")


def catalog_names() -> list[str]:
    return list(CATALOG)


# GB/s per lane, one direction: PCIe 3.0 / 4.0 / 5.0 run 8 / 16 / 32 GT/s with 128b/130b coding (0.985 / 1.97 /
# 3.94 GB/s), rounded as the catalog's x16 links (16 / 32 / 64 GB/s)
PCIE_LANE_BANDWIDTH = {3: 1 * GB, 4: 2 * GB, 5: 4 * GB}


def with_pcie_link(gpu: GpuSpec, link: str, raw: str) -> GpuSpec:
    """``gpu`` on the PCIe link a user states (``pcie3x8``: a consumer board's x8/x8 split, an older platform).
    The link carries host copies (offload) and, on boards without NVLink, the GPUs' own traffic: peer-to-peer
    over PCIe, or NCCL's SHM path through host memory where the cards have no peer access."""
    m = re.fullmatch(r"pcie(?:gen)?([345])x(1|2|4|8|16)", link.strip().lower())
    if not m:
        raise ConfigError(f"hardware {raw!r}: cannot read the PCIe link {link!r}; write @pcieGENxLANES with GEN "
                          "3, 4 or 5 and LANES 1, 2, 4, 8 or 16, e.g. 2xRTX3090-24GB@pcie3x8")
    if gpu.is_cpu:
        raise ConfigError(f"hardware {raw!r}: a PCIe link is a GPU's; drop {'@' + link!r} for the CPU")
    gen, lanes = int(m.group(1)), int(m.group(2))
    bandwidth = PCIE_LANE_BANDWIDTH[gen] * lanes
    over_pcie = gpu.intra_node_bandwidth <= gpu.pcie_bandwidth  # no NVLink: the cards talk over the same link
    return replace(gpu, pcie_bandwidth=bandwidth, pcie_link=f"pcie{gen}x{lanes}",
                   intra_node_bandwidth=bandwidth if over_pcie else gpu.intra_node_bandwidth)


def find_gpu(name: str) -> GpuSpec:
    """A catalog GPU by name, case- and dash-insensitive; a bare model (``H100``) if unambiguous."""
    key = _norm(name)
    for gpu in CATALOG.values():
        if _norm(gpu.name) == key:
            return gpu
    prefix = [g for g in CATALOG.values() if _norm(g.name).startswith(key) and key]
    exact_base = [g for g in prefix if _norm(g.name.rsplit("-", 1)[0]) == key]
    if len(exact_base) == 1:
        return exact_base[0]
    if key in ("CPU", "LOCALCPU"):
        return cpu_device()
    raise ConfigError(
        f"unknown GPU {name!r}; catalog: {', '.join(CATALOG)}, CPU (write e.g. 8xV100-32GB, 2x8xA100-80GB, "
        "or 'local' to detect this machine)"
    )


def _meminfo_bytes() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


def cpu_device() -> GpuSpec:
    """This machine's CPU as a pseudo-device: memory = RAM, FLOP/s from the core count (rough)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    flops = cores * CPU_FLOPS_PER_CORE
    return GpuSpec("CPU", _meminfo_bytes(), True, False, flops, flops, 10 * GB, 10 * GB, is_cpu=True)


def _nvidia_smi() -> list[tuple[str, int]]:
    """(name, bytes CUDA can use) per device: ``memory.total`` less ``memory.reserved`` (what the driver and
    firmware keep, ~0.5 GiB on an H100: 81559 MiB total, 79.1 GiB to CUDA); an older driver without that
    field reports the total alone."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    out = None
    for query in ("name,memory.total,memory.reserved", "name,memory.total"):
        try:
            out = subprocess.run([exe, f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout
            break
        except (OSError, subprocess.SubprocessError):
            continue
    rows = []
    for line in (out or "").strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[1].isdigit():
            kept = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else 0
            rows.append((parts[0], (int(parts[1]) - kept) * (1 << 20)))
    return rows


def _match_detected(name: str, memory: int) -> GpuSpec:
    key = _norm(name)
    best = None
    for gpu in CATALOG.values():
        base = _norm(gpu.name.rsplit("-", 1)[0])
        if base in key and (best is None or abs(gpu.memory_bytes - memory) < abs(best.memory_bytes - memory)):
            best = gpu
    if best is None:  # unknown board: keep its memory, assume a mid-range Ampere part
        best = CATALOG["A10G-24GB"]
        return replace(best, name=name.replace(" ", "-"), memory_bytes=memory)
    return replace(best, memory_bytes=memory)


def _visible_gpus() -> list[tuple[str, int]]:
    """(name, memory) of the NVIDIA devices this process may use (CUDA_VISIBLE_DEVICES applied)."""
    rows = _nvidia_smi()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if rows and visible is not None:
        wanted = [v.strip() for v in visible.split(",") if v.strip() and v.strip() != "-1"]
        rows = [rows[int(v)] for v in wanted if v.isdigit() and int(v) < len(rows)] if wanted else []
    return rows


def detect_local(cpu_ram: Optional[int] = None) -> HardwareSpec:
    """CUDA devices via nvidia-smi when present, otherwise the CPU and its RAM."""
    ram = cpu_ram if cpu_ram is not None else _meminfo_bytes()
    rows = _visible_gpus()
    rates, note = local_rates([name for name, _ in rows])
    if rows:
        gpu = _match_detected(*rows[0])
        return HardwareSpec(gpu, gpus_per_node=len(rows), nodes=1, cpu_ram_bytes=ram,
                            cpu_ram_given=cpu_ram is not None, label="local", rates=rates, rates_note=note or "")
    dev = cpu_device()
    if cpu_ram is not None:
        dev = replace(dev, memory_bytes=cpu_ram)
    return HardwareSpec(dev, 1, 1, ram, cpu_ram_given=cpu_ram is not None, label="local", rates=rates,
                        rates_note=note or "")


def local_fingerprint(gpu_names: Optional[list[str]] = None) -> str:
    """This machine's fingerprint (CPU, cores, visible GPUs, torch version): the hardware profile's key."""
    from memfit.spec import hwprofile

    names = [name for name, _ in _visible_gpus()] if gpu_names is None else gpu_names
    return hwprofile.fingerprint(hwprofile.machine_facts(names))


def local_rates(gpu_names: list[str]) -> tuple[Optional[Any], Optional[str]]:
    """The cached hardware profile of this machine (``MEMFIT_HWCAL=off``: none, the uncalibrated model)."""
    from memfit.spec import hwprofile

    if os.environ.get("MEMFIT_HWCAL", "").lower() in ("off", "0", "no", "false"):
        return None, None
    return hwprofile.load_cached(local_fingerprint(gpu_names))


def default_cpu_ram(gpu: GpuSpec, gpus_per_node: int) -> int:
    """Assumed host RAM per node when --cpu-ram is not given: 2× the node's GPU memory, at least 64 GiB."""
    return max(64 * GiB, 2 * gpu.memory_bytes * gpus_per_node)


def parse_hardware(text: str, cpu_ram: Optional[str | int] = None, nodes: Optional[int] = None) -> HardwareSpec:
    """``'8xV100-32GB'``, ``'2x8xV100-32GB'`` (nodes × GPUs), ``'V100-32GB'`` (1 GPU), ``'local'``."""
    ram = None if cpu_ram is None else parse_size(cpu_ram, "--cpu-ram")
    if ram is not None and ram <= 0:
        raise ConfigError("--cpu-ram must be positive, e.g. 128GB")
    if nodes is not None and (not isinstance(nodes, int) or nodes < 1):
        raise ConfigError(f"--nodes must be a positive integer, got {nodes!r}")
    raw = str(text).strip()
    raw_pool, _, link = raw.partition("@")
    if raw_pool.strip().lower() in ("local", "auto") and "@" in raw:
        raise ConfigError(f"hardware {raw!r}: 'local' measures this machine's own links (memfit calibrate "
                          "--hardware); drop the '@' part")
    if raw.lower() in ("local", "auto"):
        hw = detect_local(ram)
        return replace(hw, nodes=nodes) if nodes else hw
    m = re.fullmatch(r"(?:(-?\d+)\s*[xX*]\s*)?(?:(-?\d+)\s*[xX*]\s*)?(.+)", raw_pool.strip())
    if not m or not m.group(3).strip():
        raise ConfigError(f"hardware {raw!r}: write NxGPU such as 8xV100-32GB; catalog: {', '.join(CATALOG)}")
    a, b, name = m.group(1), m.group(2), m.group(3).strip()
    if b is not None:
        n_nodes, per_node = int(a), int(b)
    else:
        n_nodes, per_node = 1, int(a) if a is not None else 1
    if per_node < 1 or n_nodes < 1:
        raise ConfigError(
            f"hardware {raw!r}: GPU and node counts must be positive integers (e.g. 8xV100-32GB, "
            f"2x8xV100-32GB); catalog: {', '.join(CATALOG)}"
        )
    if name.startswith("-") or name[:1].isdigit() and "x" in name.lower()[:4]:
        raise ConfigError(f"hardware {raw!r}: cannot read the counts; write e.g. 8xV100-32GB")
    gpu = find_gpu(name)
    if "@" in raw:
        gpu = with_pcie_link(gpu, link, raw)
    if nodes is not None:
        if b is not None and nodes != n_nodes:
            raise ConfigError(f"hardware {raw!r} says {n_nodes} nodes but --nodes {nodes}; give one of them")
        n_nodes = nodes
    # "NxCPU": N processes (gloo) sharing this machine's RAM and cores
    if gpu.is_cpu and ram is not None:
        gpu = replace(gpu, memory_bytes=ram)
    node_ram = ram if ram is not None else (gpu.memory_bytes if gpu.is_cpu else default_cpu_ram(gpu, per_node))
    return HardwareSpec(gpu, per_node, n_nodes, node_ram, cpu_ram_given=ram is not None, label=raw)
