"""No drifting constants: every field of the estimator's Profile is read by memfit's code, and every Profile
constant docs/estimator.md names exists, with the value the docs give where they give one.

"Read" is textual: ``.<name>`` or the string ``"<name>"`` somewhere in memfit/ outside constants.py (a field
read only by tests, benches or docs does not count). The source is read wherever it lives, so moving a module
between packages does not matter.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from memfit.estimate.constants import RETIRED, Profile

ROOT = Path(__file__).resolve().parents[2]
CONSTANTS = ROOT / "memfit" / "estimate" / "constants.py"
DOCS = ROOT / "docs"
INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")  # `name`, not ``` fences
# `name` = 0.75 | `name` (30 MB | `name`, 2 | `name` 0.92 ; 10⁹ is 1e9, 4 % is 0.04
VALUE_CLAIM = re.compile(r"`([a-z_0-9]+)`(?: = | \(|,? )(\d+(?:\.\d+)?(?:e-?\d+)?)(⁹)?\s*(%|MB|GB|GiB|B\b)?")
UNITS = {None: 1.0, "B": 1.0, "%": 0.01, "MB": 1e6, "GB": 1e9, "GiB": float(1 << 30)}


def _memfit_source() -> dict[Path, str]:
    return {p: p.read_text() for p in sorted((ROOT / "memfit").rglob("*.py")) if p.resolve() != CONSTANTS.resolve()}


def _is_read(name: str, source: dict[Path, str]) -> bool:
    attr = re.compile(rf"\.{name}\b")
    return any(attr.search(text) or f'"{name}"' in text or f"'{name}'" in text for text in source.values())


def test_every_profile_field_is_read_by_the_code():
    source = _memfit_source()
    assert len(source) > 50  # the tree was found
    unread = [n for n in Profile.constant_names() if not _is_read(n, source)]
    assert not unread, f"Profile fields no code in memfit/ reads (retire them in constants.py's RETIRED): {unread}"


def test_the_read_check_can_fail():
    source = {Path("x.py"): "speed = p.gemm_max_fraction_x * 2  # gemm_max_fraction in a comment\n"}
    assert not _is_read("gemm_max_fraction", source)
    assert _is_read("gemm_max_fraction", {Path("x.py"): "v = profile.gemm_max_fraction\n"})
    assert _is_read("utilization_cpu", {Path("x.py"): 'NAMES = ("utilization_cpu",)\n'})


def _inline_names(text: str) -> set[str]:
    return {w for span in INLINE_CODE.findall(text) for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", span)}


def test_estimator_doc_names_only_existing_constants():
    text = (DOCS / "estimator.md").read_text()
    named = _inline_names(text)
    known = set(Profile.constant_names())
    assert len(named & known) >= 10  # the doc does name constants
    assert not named & RETIRED, f"docs/estimator.md names retired constants: {sorted(named & RETIRED)}"
    # every `name` the doc gives a value for is a constant, or something else memfit's code names (an output
    # field such as `process_baseline`, a DeepSpeed key such as `stage3_max_reuse_distance`)
    source = "\n".join(_memfit_source().values())
    claimed = {m.group(1) for m in VALUE_CLAIM.finditer(text)} - known
    nowhere = sorted(n for n in claimed if not re.search(rf"\b{n}\b", source))
    assert not nowhere, f"docs/estimator.md gives values for names memfit does not have: {nowhere}"


@pytest.mark.parametrize("doc", ["time.md", "plan.md", "measure.md"])
def test_other_docs_name_no_retired_constant_in_prose(doc):
    named = _inline_names((DOCS / doc).read_text())
    assert not named & RETIRED, f"docs/{doc} names retired constants: {sorted(named & RETIRED)}"


def _claims(text: str) -> list[tuple[str, float, str]]:
    out = []
    for m in VALUE_CLAIM.finditer(text):
        name, number, nine, unit = m.groups()
        if name not in Profile.constant_names():
            continue
        if text[max(0, m.start() - 5):m.start()].endswith("fit "):  # "the others fit `x` = 0": a fitted value
            continue
        value = float(number) ** 9 if nine else float(number)
        out.append((name, value * UNITS[unit], m.group(0).replace("\n", " ")))
    return out


def test_estimator_doc_values_are_the_profile_values():
    claims = _claims((DOCS / "estimator.md").read_text())
    assert len(claims) >= 8
    p = Profile()
    wrong = [f"{said!r} but Profile has {getattr(p, name)!r}" for name, value, said in claims
             if getattr(p, name) != pytest.approx(value, rel=1e-6, abs=1e-12)]
    assert not wrong, "docs/estimator.md gives other values than constants.py: " + "; ".join(wrong)


def test_value_claims_parse_units():
    text = ("`fragmentation` = 4 % of; `fragmentation_cpu_bytes` (30 MB) + `cpu_adam_params_per_second_node` (10⁹) "
            "`gathered_layers`, 2 = current; others fit `allocator_cached_loss` = 0.")
    got = {name: value for name, value, _ in _claims(text)}
    assert got == {"fragmentation": pytest.approx(0.04), "fragmentation_cpu_bytes": 30e6,
                   "cpu_adam_params_per_second_node": 1e9, "gathered_layers": 2.0}
