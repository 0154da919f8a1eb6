"""The hardware profiles bench/time_grid.py predicts with: the median of the calibrations taken in the
measurements' window, saved beside them, and how a report puts one in front of memfit (split out of
time_grid.py; it imports these names)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def window_profile(out: Path) -> Path:
    """``profile.json``: the median of every calibration the run took (two per group, spread through it),
    the rule memfit's own profile follows (the median of the calibrations in its window); what the report
    predicts with."""
    from dataclasses import replace

    from memfit.spec import hwprofile

    groups = sorted(out.glob("profile-*.json"), key=lambda p: p.stat().st_mtime)
    history = [h for p in groups for h in json.loads(p.read_text()).get("history") or []]
    last = hwprofile.HardwareRates.from_dict(json.loads(groups[-1].read_text()))
    merged = hwprofile.median_figures(history)
    path = out / "profile.json"
    path.write_text(json.dumps(replace(last, history=history, **merged).to_dict(), indent=1))
    return path


def use_saved_profile(path: Path, quiet: bool = False) -> None:
    """Predict with the profile calibrated in the measurements' window (saved beside them), not with
    whatever this machine's cache holds now: a fresh cache folder holding only that file."""
    import tempfile

    from memfit.spec import hwprofile

    rates = hwprofile.HardwareRates.from_dict(json.loads(path.read_text()))
    cache = Path(tempfile.mkdtemp(prefix="memfit-time-grid-cache-"))
    os.environ["MEMFIT_CACHE"] = str(cache)
    hwprofile.save(rates, hwprofile.profile_path(rates.fingerprint))
    if not quiet:
        print(f"predicting with {path} (measured {rates.measured_at})", file=sys.stderr)
