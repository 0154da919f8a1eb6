"""Hardware strings, the catalog, local detection and sizes."""

import pytest

from memfit.errors import MemfitError
from memfit.spec.hardware import CATALOG, GiB, find_gpu, parse_hardware, parse_size


def test_pool_strings():
    hw = parse_hardware("8xV100-32GB")
    assert (hw.gpus_per_node, hw.nodes, hw.world_size) == (8, 1, 8)
    assert hw.gpu.memory_bytes == int(31.74 * GiB) and not hw.gpu.bf16  # CUDA's total, not 32 GiB and not hw.gpu.fa2
    hw = parse_hardware("2x8xV100-32GB")
    assert (hw.nodes, hw.gpus_per_node, hw.world_size) == (2, 8, 16)
    hw = parse_hardware("V100-32GB")
    assert hw.world_size == 1
    assert parse_hardware("8xV100-32GB", nodes=2).world_size == 16
    assert parse_hardware("2xrtx 4090-24gb").gpu.name == "RTX4090-24GB"
    assert parse_hardware("H100").gpu.name == "H100-80GB"


def test_cpu_ram():
    hw = parse_hardware("2xRTX3090-24GB", cpu_ram="128GB")
    assert hw.cpu_ram_bytes == 128 * 10**9 and hw.cpu_ram_given
    # default: 2x the node's GPU memory, at least 64 GiB
    assert parse_hardware("8xV100-32GB").cpu_ram_bytes == 2 * 8 * int(31.74 * GiB)  # 2x the GPUs' memory
    assert parse_hardware("T4-16GB").cpu_ram_bytes == 64 * GiB


def test_catalog_covers_issue():
    for name in ("V100-16GB", "V100-32GB", "T4-16GB", "A10G-24GB", "L4-24GB", "A100-40GB", "A100-80GB",
                 "H100-80GB", "H200-141GB", "RTX3090-24GB", "RTX4090-24GB", "A5000-24GB", "A6000-48GB"):
        g = CATALOG[name]
        assert g.peak_flops > g.fp32_flops > 0 and g.pcie_bandwidth > 0
    assert CATALOG["A100-80GB"].peak_flops == 312e12


@pytest.mark.parametrize("text", ["8xFOO", "0xA100", "0xA100-80GB", "-1xV100", "-1xV100-32GB", "A100", "8x",
                                  "3x0xT4-16GB"])
def test_bad_strings(text):
    with pytest.raises(MemfitError) as err:
        parse_hardware(text)
    msg = str(err.value)
    assert "V100-32GB" in msg and "\n" not in msg


def test_local_detects_something():
    hw = parse_hardware("local")
    assert hw.world_size >= 1 and hw.gpu.memory_bytes > 0 and hw.cpu_ram_bytes > 0
    assert parse_hardware("local", cpu_ram="8GiB").cpu_ram_bytes == 8 * GiB
    hw = parse_hardware("2xCPU", cpu_ram="8GiB")
    assert hw.gpu.is_cpu and hw.world_size == 2 and hw.gpu.memory_bytes == hw.cpu_ram_bytes == 8 * GiB


@pytest.mark.parametrize("text, value", [("128GB", 128e9), ("64GiB", 64 * GiB), ("512MB", 512e6),
                                         ("1.5TB", 1.5e12), ("1000", 1000), (2048, 2048)])
def test_parse_size(text, value):
    assert parse_size(text) == int(value)


@pytest.mark.parametrize("text", ["12 parsecs", "GB", "-5GB", ""])
def test_parse_size_errors(text):
    with pytest.raises(MemfitError, match="128GB"):
        parse_size(text)


def test_local_uses_nvidia_smi_and_visible_devices(monkeypatch):
    from memfit.spec import hardware as H
    monkeypatch.setattr(H, "_nvidia_smi", lambda: [("NVIDIA A100-SXM4-80GB", 81050 << 20)] * 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    hw = H.parse_hardware("local")
    assert hw.gpus_per_node == 2 and hw.gpu.name == "A100-80GB" and hw.gpu.memory_bytes == 81050 << 20
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert H.parse_hardware("local").gpu.is_cpu
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(H, "_nvidia_smi", lambda: [("NVIDIA GeForce RTX 4090", 24564 << 20)])
    assert H.parse_hardware("local").gpu.fa2 and H.parse_hardware("local").gpu.peak_flops == 165e12


def test_a_stated_pcie_link():
    from memfit.estimate import DEFAULT_PROFILE as P
    from memfit.steptime.speeds import catalog_speeds

    hw = parse_hardware("2xRTX3090-24GB@pcie3x8")
    assert (hw.gpu.name, hw.gpu.pcie_link, hw.text()) == ("RTX3090-24GB", "pcie3x8", "2xRTX3090-24GB@pcie3x8")
    assert hw.gpu.pcie_bandwidth == hw.gpu.intra_node_bandwidth == 8e9  # no NVLink: the cards share the link
    assert parse_hardware(hw.text()) == hw  # the pool's text reads back to the same pool
    sp = catalog_speeds(hw, "bf16-mixed", "sdpa", P)
    # no peer-to-peer on a GeForce 3090: NCCL's SHM path, 0.31 of the 8 GB/s link; host copies at 0.75 of it
    assert sp.bus_bandwidth == pytest.approx(8e9 * 0.31) and sp.h2d == pytest.approx(8e9 * 0.75)
    assert catalog_speeds(parse_hardware("2xRTX3090-24GB"), "bf16-mixed", "sdpa", P).bus_bandwidth == \
        pytest.approx(32e9 * 0.31)
    nvlink = parse_hardware("8xA100-80GB@pcie5x16").gpu  # NVLink stays the GPUs' link; the host's is 64 GB/s
    assert (nvlink.intra_node_bandwidth, nvlink.pcie_bandwidth) == (300e9, 64e9)
    assert parse_hardware("2x4xH100-PCIe-80GB@pcie4x16").gpu.intra_node_bandwidth == 32e9


@pytest.mark.parametrize("text, line", [
    ("2xRTX3090-24GB@pcie3x9", "hardware '2xRTX3090-24GB@pcie3x9': cannot read the PCIe link 'pcie3x9'; write "
     "@pcieGENxLANES with GEN 3, 4 or 5 and LANES 1, 2, 4, 8 or 16, e.g. 2xRTX3090-24GB@pcie3x8"),
    ("2xRTX3090-24GB@", "hardware '2xRTX3090-24GB@': cannot read the PCIe link ''; write @pcieGENxLANES with GEN "
     "3, 4 or 5 and LANES 1, 2, 4, 8 or 16, e.g. 2xRTX3090-24GB@pcie3x8"),
    ("local@pcie3x8", "hardware 'local@pcie3x8': 'local' measures this machine's own links (memfit calibrate "
     "--hardware); drop the '@' part"),
    ("2xCPU@pcie4x16", "hardware '2xCPU@pcie4x16': a PCIe link is a GPU's; drop '@pcie4x16' for the CPU"),
])
def test_a_bad_pcie_link_is_one_line(text, line):
    with pytest.raises(MemfitError) as err:
        parse_hardware(text)
    assert str(err.value) == line


def test_a_slow_link_slows_fsdp_not_ddp_compute():
    from memfit.estimate import estimate
    from memfit.spec.model import resolve_model
    from memfit.spec.strategy import Strategy

    model = resolve_model("llama-2-7b")
    s = Strategy(method="qlora", fsdp="full_shard", gradient_checkpointing=True, seq_len=512, micro_batch_size=1)
    fast, slow = (estimate(model, parse_hardware(t), s) for t in ("2xRTX3090-24GB", "2xRTX3090-24GB@pcie3x8"))
    # FSDP's gathers of the 4-bit weights (~4 GB a step on each GPU) at 8 x 0.31 GB/s instead of 32 x 0.31
    assert slow.time["comm_seconds"] == pytest.approx(4 * fast.time["comm_seconds"], rel=0.01)
    assert slow.time["comm_seconds"] * 8e9 * 0.31 == pytest.approx(4.0e9, rel=0.05)
    assert slow.time["compute_seconds"] == pytest.approx(fast.time["compute_seconds"])
    assert slow.step_seconds > fast.step_seconds + 0.8


def test_catalog_memory_is_what_cuda_reports():
    """The verdict's card is cudaMemGetInfo's total (an OOM message's "total capacity"), not the marketing size:
    an A100-80GB holds 79.15 GiB = 84.99 GB for a process, an L40S with ECC 44.42 GiB, the H200 measured here
    150,109,880,320 B."""
    assert find_gpu("A100-80GB").memory_bytes == int(79.15 * GiB) == 84_986_665_369
    assert round(find_gpu("L40S-48GB").memory_bytes / 1e9, 2) == 47.70
    assert abs(find_gpu("H200-141GB").memory_bytes - 150_109_880_320) < 0.01 * GiB


def test_nvidia_smi_less_what_the_driver_keeps(monkeypatch):
    """memory.total less memory.reserved (H100: 81559 - 559 MiB); a driver without the field: the total."""
    import subprocess

    from memfit.spec import hardware as H

    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd[1])
        if "memory.reserved" in cmd[1] and old[0]:  # an old driver: "not a valid field to query"
            raise subprocess.CalledProcessError(6, cmd)
        out = "NVIDIA H100 80GB HBM3, 81559, 559\n" if "memory.reserved" in cmd[1] else "NVIDIA H100 80GB HBM3, 81559\n"
        return subprocess.CompletedProcess(cmd, 0, stdout=out)

    monkeypatch.setattr(H.shutil, "which", lambda exe: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(H.subprocess, "run", fake_run)
    old = [False]
    assert H._nvidia_smi() == [("NVIDIA H100 80GB HBM3", 81000 << 20)]
    old[0], calls[:] = True, []
    assert H._nvidia_smi() == [("NVIDIA H100 80GB HBM3", 81559 << 20)]
    assert calls == ["--query-gpu=name,memory.total,memory.reserved", "--query-gpu=name,memory.total"]
