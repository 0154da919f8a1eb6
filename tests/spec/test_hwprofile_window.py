"""The hardware profile follows the machine's current phase: the median of recent calibrations only, and
``memfit demo`` re-measures a profile older than that window."""

import time

from memfit.spec import hwprofile
from memfit.spec.hardware import local_fingerprint
from tests.steptime.test_time_model import rates


def test_median_of_the_calibrations_within_the_window():
    merged = None
    for op, at in ((2.0e-5, 0.0), (2.2e-5, 60.0), (1.0e-5, 3 * 3600.0)):  # the last one hours later
        merged = hwprofile.with_history(rates(op_seconds=op, measured_unix=1e9 + at), merged)
    assert len(merged.history) == 3 and merged.op_seconds == 1.0e-5  # the two of an earlier phase left out
    assert merged.basis == "measured on this machine 2026-11-30"
    merged = hwprofile.with_history(rates(op_seconds=1.2e-5, measured_unix=1e9 + 3 * 3600.0 + 60), merged)
    assert merged.op_seconds == 1.1e-5 and merged.basis.endswith("median of 2 calibrations")
    # files from before calibrations were timed: none records a time, all enter the median (as before)
    undated = hwprofile.with_history(rates(op_seconds=3e-5), rates(op_seconds=1e-5))
    assert undated.op_seconds == 2e-5


def test_demo_re_measures_a_profile_older_than_the_window(tmp_path, monkeypatch):
    import memfit.measure.hwcal as H
    from memfit.cli.hardware_cmds import refresh_local_profile

    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path))
    monkeypatch.delenv("MEMFIT_HWCAL", raising=False)
    fp = local_fingerprint()
    hwprofile.save(rates(fingerprint=fp, measured_unix=time.time() - 3 * 3600.0))
    calls, said = [], []

    def fake(progress=None, world=None):
        calls.append(1)
        return rates(fingerprint=fp, measured_unix=time.time())
    monkeypatch.setattr(H, "calibrate_hardware", fake)
    assert refresh_local_profile(hwprofile.WINDOW_SECONDS, say=said.append) is True
    assert calls == [1] and "3.0 h old" in said[0]
    assert hwprofile.load_cached(fp)[0].basis == "measured on this machine 2026-11-30"  # the new one alone
    assert refresh_local_profile(hwprofile.WINDOW_SECONDS, say=said.append) is False and calls == [1]
    monkeypatch.setenv("MEMFIT_HWCAL", "off")
    hwprofile.save(rates(fingerprint=fp, measured_unix=1.0))
    assert refresh_local_profile(hwprofile.WINDOW_SECONDS) is False and calls == [1]
