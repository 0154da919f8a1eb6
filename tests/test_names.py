"""Method and engine names belong to their registries (issue 37): pricing code asks the method or the engine,
it does not compare names (the engines' facts: memfit.engines; the methods': memfit.methods). A ratchet while the
cost model moves to one list of work: the comparisons left in memfit/estimate, memfit/steptime and memfit/plan may
only go down, and what is already clean (estimate/ and plan/ whole, the files in CLEAN) stays clean."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "memfit"
METHOD_NAMES = {"full", "lora", "qlora", "meft", "dora", "peft"}
ENGINE_NAMES = {"ddp", "zero1", "zero2", "zero3", "sgo", "fsdp", "deepspeed"}
LEFT = 8  # Compare nodes on 2026-12-07 (steptime/step.py 4, steptime/layer.py 4); lower it as they go
CLEAN_PACKAGES = ("estimate", "plan")
CLEAN = ("steptime/comm.py", "steptime/engine_host.py", "steptime/host.py", "steptime/loop.py",
         "steptime/work.py")


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


def test_name_comparisons_only_go_down():
    found = {p.relative_to(ROOT).as_posix(): comparisons(p)
             for pkg in ("estimate", "steptime", "plan") for p in sorted((ROOT / pkg).glob("*.py"))}
    total = sum(len(v) for v in found.values())
    assert total <= LEFT, {k: v for k, v in found.items() if v}
    clean = [f for f in found if f in CLEAN or f.split("/")[0] in CLEAN_PACKAGES]
    assert all(not found[f] for f in clean), {f: found[f] for f in clean if found[f]}


def test_the_scan_sees_a_comparison(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('if method == "qlora" or engine in ("zero1", "zero2"):\n    pass\nx = kind != "other"\n')
    assert comparisons(probe) == [1, 1]  # two comparisons on line 1, none on line 3
