"""What each published figure's error bar may be called, computed from the record of what was decided after
seeing which rows (bench/provenance.json), never written by hand.

A group's figures are
  * ``held_out``    when no constant, rule, mapping or row choice on that side (memory / time) was decided with
                    the group's rows in view (the fitted constants are refitted without the group, so they do
                    not count against it);
  * ``development`` when at least one was: the procedure still refits the fitted constants without the group,
                    but the rules and hand-set values it rests on were chosen against these rows;
  * ``in_sample``   for predictions at the Profile's defaults, whose fitted constants saw every group.
A bar over several groups takes the weakest of its groups' labels and lists the decisions it rests on.

    PYTHONPATH=. .venv/bin/python bench/provenance.py            # every group's label and what decided it
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RECORD = HERE / "provenance.json"
ORDER = ("in_sample", "development", "held_out")  # weakest first
KINDS = ("constant", "rule", "mapping", "row_choice")


def load(path: Path = RECORD) -> dict:
    """The record: {"memory": [decision, ...], "time": [...]}, each decision {kind, name, seen, commit, note}."""
    data = json.loads(Path(path).read_text())
    for side in ("memory", "time"):
        for d in data.get(side, []):
            if d.get("kind") not in KINDS or not isinstance(d.get("seen"), list) or not d.get("name"):
                raise ValueError(f"{path}: {side} decision {d!r}: needs kind in {KINDS}, a name and a 'seen' list")
    return data


def decisions_seeing(side: str, groups, record: dict) -> list[dict]:
    """The decisions on ``side`` made with any of ``groups``' rows in view."""
    want = set(groups)
    return [d for d in record.get(side, []) if want & set(d["seen"])]


def group_basis(side: str, group: str, record: dict) -> str:
    return "development" if decisions_seeing(side, [group], record) else "held_out"


def weakest(labels) -> str:
    labels = list(labels)
    return min(labels, key=ORDER.index) if labels else "held_out"


def basis(side: str, groups, record: dict) -> dict:
    """The label of a bar over ``groups`` (leave-one-group-out predictions), each group's label, the hand-set
    constants and the other decisions it rests on (names, sorted)."""
    groups = sorted(set(groups))
    per = {g: group_basis(side, g, record) for g in groups}
    seen = decisions_seeing(side, groups, record)
    return {"basis": weakest(per.values()), "group_basis": per,
            "hand_set": sorted({d["name"] for d in seen if d["kind"] == "constant"}),
            "rests_on": len(seen)}


def table(record: dict) -> dict:
    """Per side, per group named in any decision: its label and the decisions' names."""
    out: dict = {}
    for side in ("memory", "time"):
        groups = sorted({g for d in record.get(side, []) for g in d["seen"]})
        out[side] = {g: {"basis": group_basis(side, g, record),
                         "decisions": [f"{d['kind']}: {d['name']} ({d['commit']})"
                                       for d in decisions_seeing(side, [g], record)]} for g in groups}
    return out


def main(argv=None) -> int:
    rec = load()
    for side, groups in table(rec).items():
        print(f"{side}:")
        for g, v in groups.items():
            print(f"  {g:22s} {v['basis']:12s} {len(v['decisions'])} decision(s) made seeing its rows")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
