"""README's and docs' accuracy figures are generated blocks (bench/doc_figures.py): each must equal what the
shipped accuracy JSON gives, so a figure that drifts from the bench fails here."""

import json
import shutil
from pathlib import Path

from bench import doc_figures as D

ROOT = Path(__file__).resolve().parents[2]


def test_every_figure_block_matches_the_json():
    assert D.stale() == []


def test_every_figure_is_quoted_somewhere():
    names = {m["name"] for rel in D.FILES for m in D.BLOCK.finditer((ROOT / rel).read_text())}
    assert names == set(D.RENDER)


def _copy_docs(tmp_path: Path) -> Path:
    for rel in D.FILES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    return tmp_path


def test_a_figure_that_differs_from_the_json_fails(tmp_path):
    root = _copy_docs(tmp_path)
    mem, time = json.loads(D.MEMORY.read_text()), json.loads(D.TIME.read_text())
    mem["overall"]["left_out"]["median_abs_pct"] += 0.1  # the bench moved, README did not
    msgs = D.stale(root, mem=mem, time=time)
    assert msgs and all("\n" not in m for m in msgs)
    assert any(m.startswith("README.md: block 'memory-bar' differs") for m in msgs)
    # a hand edit inside a block is caught too
    readme = root / "README.md"
    readme.write_text(readme.read_text().replace("median |error| 2.3 %", "median |error| 1.9 %", 1))
    assert any("README.md: block 'memory-bar'" in m for m in D.stale(root))


def test_the_labels_quoted_are_the_computed_ones():
    """No bar is called held out in README unless the accuracy file's basis says so."""
    mem, time = json.loads(D.MEMORY.read_text()), json.loads(D.TIME.read_text())
    text = D.memory_bar(mem, time) + D.time_bar(mem, time)
    assert mem["basis"] == time["basis"] == "development"
    assert "development" in text and "**Held out** (a new source scored once after freezing)" in text
