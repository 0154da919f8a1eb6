"""The hardware profile's life cycle: which device kind its measured rates serve, the cache file, the
``memfit calibrate --hardware`` command, the planner naming its basis and reading the profile without torch,
and the micro-benchmarks / gloo collectives it is made of (split from tests/steptime/test_time_model.py)."""

import json
import subprocess
import sys
from dataclasses import replace

from memfit.estimate import estimate
from memfit.spec import hwprofile
from memfit.spec.hardware import local_fingerprint, parse_hardware
from memfit.spec.strategy import Strategy
from cli_helper import run_cli
from test_time_model import BASE, TINY, rates


def test_measured_rates_only_for_their_device_kind():
    gpu = replace(parse_hardware("A100-80GB"), rates=rates())  # a CPU profile never times a GPU pool
    assert estimate(TINY, gpu, Strategy(**BASE)).time["basis"].startswith("catalog")


def test_cache_file_read_ignored_with_a_note(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path))
    monkeypatch.delenv("MEMFIT_HWCAL", raising=False)  # conftest turns the calibration off
    fp = local_fingerprint()
    assert hwprofile.load_cached(fp) == (None, None)  # nothing cached: no note
    path = hwprofile.save(rates(fingerprint=fp))
    assert path == tmp_path / f"hardware-{fp}.json"
    got, note = hwprofile.load_cached(fp)
    assert note is None and got == rates(fingerprint=fp)
    hw = parse_hardware("local")
    assert hw.rates == got and hw.rates_note == ""
    monkeypatch.setenv("MEMFIT_HWCAL", "off")
    assert parse_hardware("local").rates is None
    monkeypatch.delenv("MEMFIT_HWCAL")
    path.write_text("{not json")
    got, note = hwprofile.load_cached(fp)
    assert got is None and note.startswith(f"ignoring the hardware profile {path}") and "\n" not in note
    hwprofile.save(rates(fingerprint="other"), path)  # copied from another machine
    got, note = hwprofile.load_cached(fp)
    assert got is None and "measured on another machine" in note
    assert parse_hardware("local").rates_note == note


_cli = run_cli


def test_calibrate_hardware_cli_caches_and_forces(tmp_path, monkeypatch, capsys):
    import memfit.measure.hwcal as H

    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path))
    monkeypatch.delenv("MEMFIT_HWCAL", raising=False)
    calls = []

    def fake(progress=None, world=None):
        calls.append(1)
        progress and progress("[1/1] GEMM (0 s)")
        return rates(fingerprint=local_fingerprint())
    monkeypatch.setattr(H, "calibrate_hardware", fake)
    code, out, err = _cli(capsys, "calibrate", "--hardware")
    assert code == 0 and calls == [1] and "measured now" in out and "[1/1] GEMM" in err
    code, out, _ = _cli(capsys, "calibrate", "--hardware")
    assert code == 0 and calls == [1] and "cached" in out
    code, out, _ = _cli(capsys, "calibrate", "--hardware", "--force", "--json")
    assert code == 0 and calls == [1, 1] and json.loads(out)["measured_now"] is True
    path = hwprofile.profile_path(local_fingerprint())
    path.write_text('{"schema": "%s", "device": 3}' % hwprofile.SCHEMA)  # corrupt
    code, out, err = _cli(capsys, "calibrate", "--hardware")
    assert code == 0 and calls == [1, 1, 1] and "Traceback" not in err
    assert err.count("note:") == 1 and "ignoring the hardware profile" in err
    code, out, _ = _cli(capsys, "calibrate")
    assert code == 2 and "give --hardware" in out + _


def test_plan_names_the_basis(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path))
    monkeypatch.delenv("MEMFIT_HWCAL", raising=False)  # conftest turns the calibration off
    hwprofile.save(rates(fingerprint=local_fingerprint()))
    code, out, _ = _cli(capsys, "estimate", "--model", "llama-2-7b", "--gpus", "local", "--method", "lora",
                        "--seq-len", "128", "--json")
    assert code == 0 and json.loads(out)["time"]["basis"] == "measured on this machine 2026-11-30"
    code, out, _ = _cli(capsys, "estimate", "--model", "llama-2-7b", "--gpus", "A100-80GB", "--seq-len", "128")
    assert code == 0 and "catalog GPU, parts model (memfit.steptime), uncalibrated" in out.replace("\n", " ")


def test_planning_reads_the_profile_without_torch(tmp_path):
    import os

    hwprofile.save(rates(fingerprint=local_fingerprint()), tmp_path / f"hardware-{local_fingerprint()}.json")
    code = ("import sys, json; from memfit.spec.hardware import parse_hardware; from memfit.estimate import "
            "estimate; from memfit.spec.model import resolve_model; from memfit.spec.strategy import Strategy; "
            "hw = parse_hardware('local'); b = estimate(resolve_model('llama-2-7b'), hw, "
            "Strategy(method='lora', seq_len=128)).time['basis']; "
            "print(json.dumps([hw.rates is not None, 'torch' in sys.modules, b]))")
    env = {**os.environ, "MEMFIT_CACHE": str(tmp_path)}
    env.pop("MEMFIT_HWCAL", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, False, "measured on this machine 2026-11-30"]


def test_micro_benchmarks_return_rates():
    import torch

    from memfit.measure import kernels as H

    torch.set_num_threads(1)
    timer = H.Timer("cpu", one_thread=True)
    assert 1e8 < H.bandwidth_rate("cpu", timer) < 1e13
    assert 1e-8 < H.op_seconds("cpu", timer) < 1e-2
    # a fresh 64 MB mapping's page faults and zeroing: ~0.6-0.9 ns per byte here, never ~0 (its own mapping)
    assert 1e-12 < H.first_touch_seconds_per_byte(timer) < 1e-7
    adam = H.adamw_seconds("cpu", timer)
    assert 0 < adam["per_param"] < 1e-6 and adam["per_tensor"] >= 0
    att = H.attention_rates("cpu", ["fp32"], timer)
    assert set(att["eager"]["fp32"]) == set(att["sdpa"]["fp32"]) == {"128", "256", "1024"}
    parts = att["eager_parts"]["fp32"]
    assert set(parts["scores"]) == {str(1 << 20), str(16 << 20), str(32 << 20)} and parts["bmm"] > 1e8
    assert parts["bmm_half_d"] > 1e8 and parts["bmm_head_dim"] == 32  # the products at d / 2, twice the heads
    assert 0 < parts["scores_forward_share"] <= 1 and 0 < att["forward_share"]["sdpa"] <= 1
    assert min(att["eager"]["fp32"].values()) > 1e8 and min(att["sdpa"]["fp32"].values()) > 1e8


def test_gloo_collective_between_forked_processes():
    from memfit.measure.collective_bench import collective_rates

    c = collective_rates(2, "gloo")
    assert c["backend"] == "gloo" and c["bus_bytes_per_s"] > 1e6 and 0 < c["latency_s"] < 0.1
    for op in ("all_gather", "reduce_scatter"):  # the tensor forms FSDP2 / DeepSpeed gathers use
        assert c[op]["bus_bytes_per_s"] > 1e6 and 0 < c[op]["latency_s"] < 0.1
    assert set(c["concurrency"]) == {"gemm", "ops"} and min(c["concurrency"].values()) >= 1.0
