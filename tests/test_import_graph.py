"""The import graph of memfit: every import of a memfit module, at module level or inside a function
(read with ast, nothing is imported), must follow the layers of ARCHITECTURE.md, and no two packages may
import each other (directly or round a longer cycle).

Layers, lowest first; a module may import its own layer and the ones below it:

    errors, io                      shared leaves
    methods, meft, engines          the method registry (plain Python; its build steps import torch and
                                    memfit.meft inside functions), the MEFT adapter package and the
                                    engines' cost records (plain Python)
    spec                            RunSpec, Strategy (validated against the method registry), ModelSpec...
    estimate                        the estimator
    resolve                         resolve(run) -> Resolved(model, hardware, strategy, world)
    plan                            rules, search, matrix
    distributed                     the engines registry, launch, pre-flight, plan --emit
    train                           training (transformers Trainer), --fallback
    measure                         probes, runner, calibration, trace, the engines' rank matrix
    cli                             typer commands
    __main__ modules                entry points (python -m memfit / memfit.train), outside the graph
"""

from __future__ import annotations

import ast
from pathlib import Path

import memfit

ROOT = Path(memfit.__file__).resolve().parent
LAYERS = {
    "errors": 0, "io": 0,
    "methods": 1, "meft": 1, "engines": 1,
    "spec": 2,
    "steptime": 2.5,
    "estimate": 3,
    "resolve": 4,
    "plan": 5,
    "distributed": 6,
    "train": 7,
    "measure": 8,
    "ui": 8.5,
    "cli": 9,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported memfit module, line) for every import statement anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "memfit"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "memfit":
                continue
            for a in node.names:  # `from memfit.plan import rules` imports the module memfit.plan.rules
                sub = f"{module}.{a.name}"
                found.append((sub if sub in known else module, node.lineno))
    return found


def _package(module: str) -> str | None:
    """memfit.plan.rules -> 'plan'; None for memfit itself and the entry points (__main__)."""
    parts = module.split(".")
    if len(parts) < 2 or parts[-1] == "__main__":
        return None
    return parts[1]


def _edges() -> list[tuple[str, str, str, int]]:
    known = _modules()
    edges = []
    for name, path in known.items():
        for target, line in _imports(name, path, known):
            edges.append((name, target, str(path.relative_to(ROOT.parent)), line))
    return edges


def test_every_package_has_a_layer():
    packages = {_package(m) for m in _modules()} - {None}
    assert packages <= set(LAYERS), f"packages without a layer in this test: {sorted(packages - set(LAYERS))}"


def test_every_imported_memfit_module_exists():
    known = set(_modules())
    missing = [f"{where}:{line}: {target}" for _, target, where, line in _edges() if target not in known]
    assert not missing, "imports of memfit modules that do not exist:\n" + "\n".join(missing)


def test_imports_follow_the_layers():
    wrong = []
    for source, target, where, line in _edges():
        a, b = _package(source), _package(target)
        if a is None or b is None or a == b:
            continue
        if LAYERS[b] > LAYERS[a]:
            wrong.append(f"{where}:{line}: {source} ({a}) imports {target} ({b}), a higher layer")
    assert not wrong, "\n".join(wrong)


def test_no_cycle_between_packages():
    graph: dict[str, set[str]] = {}
    for source, target, _, _ in _edges():
        a, b = _package(source), _package(target)
        if a and b and a != b:
            graph.setdefault(a, set()).add(b)
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif len(path) < len(LAYERS):
                visit(nxt, path + [nxt])

    for start in sorted(graph):
        visit(start, [start])
    assert not cycles, "\n".join(sorted(set(cycles)))


def test_the_walk_sees_function_level_imports(tmp_path):
    """The checker would catch an import hidden inside a function (the way train and distributed once
    imported each other)."""
    mod = tmp_path / "memfit" / "plan" / "x.py"
    mod.parent.mkdir(parents=True)
    mod.write_text("def f():\n    from memfit.train.api import train\n    from . import rules\n")
    known = {"memfit.plan.x": mod, "memfit.plan.rules": mod, "memfit.train.api": mod}
    assert _imports("memfit.plan.x", mod, known) == [("memfit.train.api", 2), ("memfit.plan.rules", 3)]
