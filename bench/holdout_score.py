"""Freeze, then score a new public source once (docs/estimator.md#freeze-then-score).

A new source's rows (bench/holdout/*.jsonl, the gpu-runs schema) are predicted with the Profile's defaults:
no fitted constant has seen them, and the ledger (bench/holdout/ledger.json) records the commit whose code
and mapping rules (bench/gpu_published_rows.convert, bench/public_time_rows.convert) were frozen before the
rows were read. The first reading is computed by that commit's own code, in a git worktree, and written to
the ledger once; later commits recompute a current reading beside it, never over it.

    PYTHONPATH=. .venv/bin/python bench/holdout_score.py                 # first and current readings
    PYTHONPATH=. .venv/bin/python bench/holdout_score.py --json
    PYTHONPATH=. .venv/bin/python bench/holdout_score.py --read FILE --side memory|time   # one reading, this code
    PYTHONPATH=. .venv/bin/python bench/holdout_score.py --first GROUP   # score GROUP at its frozen commit, once
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

LEDGER = HERE / "holdout" / "ledger.json"


def _stats(errs: list[float]) -> dict:
    if not errs:
        return {"median_abs_pct": None, "max_abs_pct": None, "median_signed_pct": None}
    return {"median_abs_pct": round(100 * statistics.median(abs(e) for e in errs), 1),
            "max_abs_pct": round(100 * max(abs(e) for e in errs), 1),
            "median_signed_pct": round(100 * statistics.median(errs), 1)}


def _prepared(path: Path, tmp: Path) -> tuple[Path, dict]:
    """The rows as bench/holdout_rows.prepare maps them (a file in ``tmp``), and those it skips (id -> why)."""
    from bench import holdout_rows

    keep, skipped = [], {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            ready = holdout_rows.prepare(row)
            if ready is None:
                skipped[row["id"]] = holdout_rows.skip_reason(row)
            else:
                keep.append(json.dumps(ready))
    out = tmp / Path(path).name
    out.write_text("\n".join(keep) + "\n")
    return out, skipped


def read_memory(path: Path) -> dict:
    """Every row bench/gpu_published_rows.convert expresses, predicted at the Profile's defaults."""
    from bench import gpu_published as G, holdout_rows

    with tempfile.TemporaryDirectory() as tmp, holdout_rows.registered(Path(tmp) / "configs"):
        rows, pre = _prepared(path, Path(tmp))
        cases, skipped = G.load(rows)
        skipped += [{"id": k, "why": v} for k, v in pre.items()]
        results = [G.predict(c) for c in cases]
    s = G.summarize(results)
    errs = [r["error"] for r in results if r["error"] is not None]
    groups = {g: _stats([r["error"] for r in results if r["group"] == g and r["error"] is not None])
              for g in sorted({r["group"] for r in results})}
    return {"side": "memory", "rows": s["rows"], "figures": len(errs), **_stats(errs), "groups": groups,
            "under_10": len(s["under_10"]), "oom_called_fitting": len(s["oom_called_fitting"]),
            "ran_called_not_fitting": len(s["ran_called_not_fitting"]),
            "per_row": {r["id"]: None if r["error"] is None else round(100 * r["error"], 1) for r in results},
            "skipped": {k["id"]: k["why"] for k in skipped}}


def read_time(path: Path) -> dict:
    """Every row bench/public_time_rows.convert expresses, predicted at the Profile's defaults (tokens/s)."""
    from bench import gpu_time_fit as F, holdout_rows
    from bench.public_time_rows import load

    with tempfile.TemporaryDirectory() as tmp, holdout_rows.registered(Path(tmp) / "configs"):
        rows, pre = _prepared(path, Path(tmp))
        cases, skipped = load(rows)
        skipped += [{"id": k, "reason": v} for k, v in pre.items()]
        errs = [F.predict(c) / c.published_tps_per_gpu - 1.0 for c in cases]
    groups = {g: _stats([e for c, e in zip(cases, errs) if c.group == g]) for g in sorted({c.group for c in cases})}
    return {"side": "time", "rows": len(cases), "figures": len(errs), **_stats(errs), "groups": groups,
            "per_row": {c.id: round(100 * e, 1) for c, e in zip(cases, errs)},
            "skipped": {k["id"]: k["reason"] for k in skipped}}


def read(path: Path, side: str) -> dict:
    return read_memory(path) if side == "memory" else read_time(path)


def ledger(path: Path = LEDGER) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {"sources": {}}


def first_reading(group: str, book: dict, root: Path = HERE.parent) -> dict:
    """The reading of ``group``'s rows by its frozen commit's code (a throwaway git worktree)."""
    entry = book["sources"][group]
    rows = (root / entry["file"]).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "frozen"
        subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(tree), entry["frozen_commit"]],
                       check=True, capture_output=True)
        try:
            out = subprocess.run([sys.executable, str(tree / "bench" / "holdout_score.py"), "--read", str(rows),
                                  "--side", entry["side"]], check=True, capture_output=True, text=True,
                                 env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}, cwd=tree)
        finally:
            subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(tree)], capture_output=True)
    return json.loads(out.stdout)


def readings(book: dict | None = None, root: Path = HERE.parent) -> list[dict]:
    """Per scored source: its frozen commit, first reading (from the ledger) and current reading (this code)."""
    book = ledger() if book is None else book
    out = []
    for group, e in sorted(book["sources"].items()):
        if not e.get("first_reading"):
            continue
        now = read(root / e["file"], e["side"])
        keep = ("rows", "figures", "median_abs_pct", "max_abs_pct", "median_signed_pct", "groups", "under_10",
                "oom_called_fitting", "ran_called_not_fitting")
        out.append({"source": group, "side": e["side"], "address": e.get("address"),
                    "frozen_commit": e["frozen_commit"], "scored": e["scored_date"],
                    "first": {k: e["first_reading"].get(k) for k in keep},
                    "current": {k: now.get(k) for k in keep}})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--read", type=Path, help="one reading of this rows file with this checkout's code (JSON)")
    ap.add_argument("--side", choices=("memory", "time"), default="memory")
    ap.add_argument("--first", metavar="GROUP", help="score GROUP at its frozen commit and record it (once)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.read:
        print(json.dumps(read(args.read, args.side)))
        return 0
    book = ledger()
    if args.first:
        entry = book["sources"].get(args.first)
        if entry is None:
            print(f"error: --first {args.first}: not in {LEDGER.name}; freeze it there first", file=sys.stderr)
            return 2
        if entry.get("first_reading"):
            print(f"error: --first {args.first}: already scored on {entry['scored_date']}; the first reading "
                  "stays as recorded", file=sys.stderr)
            return 2
        entry["first_reading"] = first_reading(args.first, book)
        entry["scored_date"] = datetime.date.today().isoformat()
        LEDGER.write_text(json.dumps(book, indent=1) + "\n")
    table = readings(book)
    if args.json:
        print(json.dumps(table, indent=1))
        return 0
    for r in table:
        f, c = r["first"], r["current"]
        print(f"{r['source']} ({r['side']}, frozen at {r['frozen_commit'][:9]}, scored {r['scored']}): first reading "
              f"median |e| {f['median_abs_pct']} %, max {f['max_abs_pct']} % on {f['figures']} figures; current "
              f"{c['median_abs_pct']} % / {c['max_abs_pct']} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
