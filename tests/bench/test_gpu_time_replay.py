"""The time model against the step times measured on an H200 (bench/results, replayed without a GPU)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_h200_bare_loop_replayed_within_the_measured_error():
    saved = ROOT / "bench/results/gpu_time_check_h200_2026-11-30_third.json"
    out = subprocess.run([sys.executable, "-m", "bench.gpu_time_check", "--replay", str(saved)],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    calibrated = out.split("-- catalog")[0]
    median, worst = map(float, re.search(r"median ([\d.]+) %, max ([\d.]+) % \(n=15\)", calibrated).groups())
    tau = float(re.search(r"Kendall tau, seq 1024 \(9 configurations\): ([-\d.]+)", calibrated).group(1))
    # measured then: median 6.4 %, max 20.4 %, tau 0.89 (docs/gpu-time.md)
    assert median <= 10.0 and worst <= 25.0 and tau >= 0.8
    assert "measured on this machine 2026-11-30" in calibrated
    assert "catalog GPU, parts model (memfit.steptime), uncalibrated" in out.split("-- catalog")[1]
