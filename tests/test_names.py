"""Method and engine names belong to their registries (issue 37): code asks the method (memfit.methods) or the
engine's record (memfit.engines), it does not compare names. Comparisons with a method or engine name may appear
only in the registries themselves and where people type or read names (the CLI, the page, the spec's
validation); the pricing packages (estimate, steptime, plan) and the rest (train, measure, distributed, resolve)
have none."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "memfit"
METHOD_NAMES = {"full", "lora", "qlora", "meft", "dora", "peft"}
ENGINE_NAMES = {"ddp", "zero1", "zero2", "zero3", "sgo", "fsdp", "deepspeed"}
ALLOWED = ("methods/", "engines/", "distributed/engines/", "cli/", "ui/", "spec/")


def _names(node) -> set:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_names(e) for e in node.elts)) if node.elts else set()
    return set()


def comparisons(path: Path) -> list[int]:
    """Lines of ``path`` comparing with a method or engine name (==, !=, in, not in)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            names = _names(node.left).union(*(_names(c) for c in node.comparators))
            if names & (METHOD_NAMES | ENGINE_NAMES):
                out.append(node.lineno)
    return out


def test_no_name_comparisons_outside_the_registries_and_the_interface():
    found = {p.relative_to(ROOT).as_posix(): comparisons(p) for p in sorted(ROOT.rglob("*.py"))}
    left = {k: v for k, v in found.items() if v and not k.startswith(ALLOWED)}
    assert not left, left


def test_the_scan_sees_a_comparison(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('if method == "qlora" or engine in ("zero1", "zero2"):\n    pass\nx = kind != "other"\n')
    assert comparisons(probe) == [1, 1]  # two comparisons on line 1, none on line 3
