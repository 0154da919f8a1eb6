"""The accuracy figures README.md and docs/ quote, generated from the shipped JSON the benches write
(memfit/estimate/published_accuracy.json, memfit/steptime/published_time_accuracy.json) and memfit's own GPU
records, into marked blocks:

    <!-- figures:NAME -->
    ...generated text...
    <!-- /figures:NAME -->

    PYTHONPATH=. .venv/bin/python bench/doc_figures.py            # list the blocks and whether each is current
    PYTHONPATH=. .venv/bin/python bench/doc_figures.py --write    # rewrite every block from the JSON
    PYTHONPATH=. .venv/bin/python bench/doc_figures.py --check    # exit 1 naming each stale block (the tests run it)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

MEMORY = ROOT / "memfit" / "estimate" / "published_accuracy.json"
TIME = ROOT / "memfit" / "steptime" / "published_time_accuracy.json"
H200 = HERE / "results" / "gpu_time_check_h200_2026-11-30_third.json"
FILES = ("README.md", "docs/estimator.md", "docs/gpu-time.md", "docs/methods.md", "docs/long-context.md")
LONG_CONTEXT = ROOT / "bench" / "results" / "long_context.json"  # bench/long_context.py --json
BLOCK = re.compile(r"<!-- figures:(?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- /figures:(?P=name) -->", re.S)
LABEL = {"held_out": "held out", "development": "development", "in_sample": "in-sample"}


def _span(r: dict) -> str:
    lo, hi = (f"{r[k]:+.1f}".replace("-", "−") for k in ("min_pct", "max_pct"))
    return f"{lo} %" if r["min_pct"] == r["max_pct"] else f"{lo} … {hi} %"


def _floor(f: dict) -> str:
    return (f"{f['configs']} configurations measured more than once ({f['measurements']} figures) differ by median "
            f"{f['median_spread_pct']:.1f} %, up to {f['max_spread_pct']:.1f} %")


def memory_bar(mem: dict, time: dict) -> str:
    o, i, n = mem["overall"]["left_out"], mem["overall"]["in_sample"], mem["counts"]
    reads = "; ".join(f"{r['address'].split(' @')[0]}: median {r['first']['median_abs_pct']:.1f} %, max "
                      f"{r['first']['max_abs_pct']:.1f} % on {r['first']['figures']} figures, "
                      f"{r['first']['oom_called_fitting']} OOM runs called fitting, "
                      f"{r['first']['ran_called_not_fitting']} "
                      f"that ran called not fitting (frozen at {r['frozen_commit'][:7]}, scored {r['scored']})"
                      for r in mem["held_out_readings"])
    return (f"`PYTHONPATH=. .venv/bin/python bench/gpu_published.py` predicts {n['published_runs']} published GPU runs "
            f"({n['peft_runs']} of {n['peft_methods']} PEFT methods, `method=peft`) and memfit's {n['gpu_check_runs']} "
            f"H200 runs with the fitted constants refitted without each source group: median |error| "
            f"{o['median_abs_pct']:.1f} %, max {o['max_abs_pct']:.1f} % over {o['figures']} figures. That is a "
            f"**development** figure, not a held-out one: {mem['rests_on']} rules, mappings and constants were chosen "
            f"with these rows in view (`bench/provenance.json`; `basis` in `--json`). In-sample: median "
            f"{i['median_abs_pct']:.1f} %, max {i['max_abs_pct']:.1f} %. Verdicts: {o['oom_called_fitting']} of "
            f"{o['oom_runs']} OOM runs called fitting; {o['ran_called_not_fitting']} of the {o['ran_runs']} runs that "
            f"ran refused at the planner's 5 % margin. Noise floor: {_floor(mem['noise_floor'])}. "
            f"**Held out** (a new source scored once after freezing): {reads or 'none yet'}.\n")


def time_bar(mem: dict, time: dict) -> str:
    reads = "; ".join(f"median {r['first']['median_abs_pct']:.1f} %, max {r['first']['max_abs_pct']:.1f} % on "
                      f"{r['first']['figures']} rows of {', '.join(sorted(r['first']['groups']))} (frozen at "
                      f"{r['frozen_commit'][:7]})" for r in time["held_out_readings"])
    return (f"(`PYTHONPATH=. python bench/gpu_time_fit.py`: {time['rows']} runs, median "
            f"{time['median_abs_pct']:.1f} %, max {time['max_abs_pct']:.0f} %, a development figure: "
            f"{time['rests_on']} choices made seeing these rows, "
            f"{len(time['hand_set'])} of them hand-set constants; repeated configurations differ by median "
            f"{time['noise_floor']['median_spread_pct']:.1f} %, up to {time['noise_floor']['max_spread_pct']:.0f} %; "
            f"held out on new sources: {reads or 'none yet'}; [docs/gpu-time.md](docs/gpu-time.md)).\n")


def h200_time(mem: dict, time: dict) -> str:
    from bench import gpu_time_check as gtc
    from memfit.spec import hwprofile
    from memfit.spec.hardware import parse_hardware

    raw = json.loads(H200.read_text())
    pool = gtc._with_rates(parse_hardware(raw["catalog_pool"]), hwprofile.HardwareRates.from_dict(raw["profile"]))
    gtc.report(raw["rows"], raw["shape"], pool, raw["device"])
    rows = [r for r in raw["rows"] if "measured_ms" in r]

    def stats(sub):
        errs = [abs(r["predicted_ms"] / r["measured_ms"] - 1) * 100 for r in sub]
        return f"median |error| {statistics.median(errs):.1f} %, max {max(errs):.1f} %"

    long = [r for r in rows if r["config"]["seq"] == 1024]
    probes = [r for r in rows if r["config"]["seq"] == 16]
    return (f"Calibrated on an H200 (`bench/gpu_time_check.py --replay {H200.relative_to(ROOT)}`; a development "
            f"figure: the model was changed after the first two runs on that machine): over the {len(long)} "
            f"1024-token configurations {stats(long)}; over all {len(rows)} rows, the {len(probes)} 16-token host "
            f"probes included, {stats(rows)}.\n")


def memory_kinds(mem: dict, time: dict) -> str:
    lines = ["| kind | figures (runs) | leave-one-group-out | median \\|e\\| | basis | in-sample | median \\|e\\| "
             "| wrong verdicts |", "|---|---|---|---|---|---|---|---|"]
    for kind, k in mem["kinds"].items():
        wrong = k["oom_called_fitting"] + k["ran_called_not_fitting"]
        lines.append(f"| {kind} | {k['figures']} ({k['rows']}) | {_span(k)} | {k['median_abs_pct']:.1f} % | "
                     f"{LABEL[k['basis']]} ({k['rests_on']} choices) | {_span(k['in_sample'])} | "
                     f"{k['in_sample']['median_abs_pct']:.1f} % | {wrong} of {k['verdicts']} |")
    return "\n".join(lines) + "\n"


def _group_table(first: str, groups: dict, total: tuple[str, str, dict]) -> str:
    """Per source group (and a bold total row): basis, figures, median and max |error|, wrong verdicts."""
    lines = [f"| {first} | basis | figures | median \\|e\\| | max \\|e\\| | > 10 % under | OOM called fitting | "
             "ran, called not fitting |", "|---|---|---|---|---|---|---|---|"]

    def row(name: str, basis: str, v: dict, b: str = "") -> str:
        cells = (name, LABEL[basis], v["figures"], f"{v['median_abs_pct']:.1f} %", f"{v['max_abs_pct']:.1f} %",
                 v["under_10"], f"{v['oom_called_fitting']} of {v['oom_runs']}",
                 f"{v['ran_called_not_fitting']} of {v['ran_runs']}")
        return "| " + " | ".join(f"{b}{c}{b}" for c in cells) + " |"
    lines += [row(g, v["basis"], v) for g, v in groups.items()]
    lines.append(row(*total, "**"))
    return "\n".join(lines) + "\n"


def memory_groups(mem: dict, time: dict) -> str:
    return _group_table("group left out", mem["groups_left_out"], ("all", mem["basis"], mem["overall"]["left_out"]))


def memory_groups_in_sample(mem: dict, time: dict) -> str:
    return _group_table("group", mem["groups_in_sample"],
                        ("overall, in-sample", "in_sample", mem["overall"]["in_sample"]))


def time_groups(mem: dict, time: dict) -> str:
    lines = ["| group | rows | in-sample median / max | left out median / max | basis | τ (configurations) |",
             "|---|---|---|---|---|---|"]
    for g, v in time["by_group"].items():
        taus = ", ".join(f"{mg} {t:+.2f} ({n})" for mg, (t, n) in v["kendall"].items()) or "–"
        name, bold = ("**all**", "**") if g == "all" else (g, "")
        ins, out = (f"{bold}{v[k][0]:.1f} % / {v[k][1]:.1f} %{bold}" for k in ("in_sample", "left_out"))
        lines.append(f"| {name} | {bold}{v['rows']}{bold} | {ins} | {out} | {LABEL[v['basis']]} | "
                     f"{'' if g == 'all' else taus} |")
    return "\n".join(lines) + "\n"


def time_kinds(mem: dict, time: dict) -> str:
    lines = ["| kind | rows | leave-one-group-out | median \\|e\\| | basis | hand-set constants it rests on |",
             "|---|---|---|---|---|---|"]
    for kind, k in time["kinds"].items():
        lines.append(f"| {kind} | {k['rows']} | {_span(k)} | {k['median_abs_pct']:.1f} % | {LABEL[k['basis']]} "
                     f"({k['rests_on']} choices) | {len(k['hand_set'])} |")
    lines.append(f"| **named methods, all** | **{time['rows']}** | | **{time['median_abs_pct']:.1f} %** (max "
                 f"{time['max_abs_pct']:.1f} %) | **{LABEL[time['basis']]}** | {len(time['hand_set'])}: "
                 + "; ".join(n.split(" (")[0].split(":")[0] for n in time["hand_set"]) + " |")
    return "\n".join(lines) + f"\n\nNoise floor: {_floor(time['noise_floor'])}.\n"


def peft_bars(mem: dict, time: dict) -> str:
    k, m = time["kinds"]["peft, 1 GPU"], mem["kinds"]["peft, 1 GPU"]
    return (f"`method=peft` on PEFT's L40S runs — time: {k['rows']} rows, {_span(k)}, median "
            f"{k['median_abs_pct']:.1f} %; memory: {m['figures']} figures of {mem['counts']['peft_methods']} methods, "
            f"{_span(m)}, median {m['median_abs_pct']:.1f} %. Both are **development** figures: the per-type rules "
            f"were written against these rows ({k['rests_on']} and {m['rests_on']} choices made seeing them).\n")


def readings(side: str):
    def render(mem: dict, time: dict) -> str:
        data = mem if side == "memory" else time
        lines = ["| source | frozen at | scored | figures | first reading: median / max \\|e\\| | current |",
                 "|---|---|---|---|---|---|"]
        for r in data["held_out_readings"]:
            f, c = r["first"], r["current"]
            lines.append(f"| {r['address']} | {r['frozen_commit'][:7]} | {r['scored']} | {f['figures']} | "
                         f"{f['median_abs_pct']:.1f} % / {f['max_abs_pct']:.1f} % (signed median "
                         f"{f['median_signed_pct']:+.1f} %) | {c['median_abs_pct']:.1f} % / {c['max_abs_pct']:.1f} % |")
        return "\n".join(lines) + "\n"
    return render


def long_context(mem: dict, time: dict) -> str:
    """The long-context bench's summary against the issue's targets (bench/results/long_context.json)."""
    d = json.loads(LONG_CONTEXT.read_text())
    f, t = d["figures"], d["targets"]
    names = (("memory_median_abs_pct", "per-GPU memory, median \\|error\\|"),
             ("memory_max_abs_pct", "per-GPU memory, max \\|error\\|"),
             ("longest_median_abs_pct", "longest length memfit calls fitting, median \\|error\\|"),
             ("tokens_per_s_median_abs_pct", "tokens/s, median \\|error\\|"))
    lines = ["| figure | memfit | target |", "|---|---|---|"]
    lines += [f"| {label} | {f[k]:.1f} % | <= {t[k]:.0f} % |" for k, label in names]
    return ("\n".join(lines) + f"\n\n{d['stated']} of {d['rows']} published figures stated, {d['not_stated']} not "
            f"(each with its reason); basis: memory {d['basis']['memory']}, time {d['basis']['time']} (the mapping "
            "was decided seeing these rows).\n")


RENDER = {"long-context": long_context,
          "memory-bar": memory_bar, "time-bar": time_bar, "h200-time": h200_time, "memory-kinds": memory_kinds,
          "memory-groups": memory_groups, "memory-groups-in-sample": memory_groups_in_sample,
          "time-groups": time_groups, "time-kinds": time_kinds, "peft-bars": peft_bars,
          "memory-readings": readings("memory"), "time-readings": readings("time")}


def stale(root: Path = ROOT, mem: dict | None = None, time: dict | None = None) -> list[str]:
    """One line per block that differs from what the JSON gives now (or names no known figure)."""
    mem = json.loads(MEMORY.read_text()) if mem is None else mem
    time = json.loads(TIME.read_text()) if time is None else time
    out, cache = [], {}
    for rel in FILES:
        for m in BLOCK.finditer((root / rel).read_text()):
            name = m["name"]
            if name not in RENDER:
                out.append(f"{rel}: block {name!r} is not a known figure ({', '.join(RENDER)})")
                continue
            want = cache.setdefault(name, RENDER[name](mem, time))
            if m["body"] != want:
                out.append(f"{rel}: block {name!r} differs from the JSON; run: PYTHONPATH=. .venv/bin/python "
                           "bench/doc_figures.py --write")
    return out


def write(root: Path = ROOT) -> list[str]:
    mem, time = json.loads(MEMORY.read_text()), json.loads(TIME.read_text())
    cache: dict = {}
    changed = []
    for rel in FILES:
        path = root / rel
        text = path.read_text()
        new = BLOCK.sub(lambda m: (f"<!-- figures:{m['name']} -->\n" + cache.setdefault(
            m["name"], RENDER[m["name"]](mem, time)) + f"<!-- /figures:{m['name']} -->"), text)
        if new != text:
            path.write_text(new)
            changed.append(rel)
    return changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    if args.write:
        print("rewrote: " + (", ".join(write()) or "nothing (all current)"))
        return 0
    msgs = stale()
    for m in msgs:
        print(m, file=sys.stderr)
    if not msgs:
        print("every figure block is current")
    return 1 if msgs else 0


if __name__ == "__main__":
    sys.exit(main())
