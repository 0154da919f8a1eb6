"""Draw a Matrix as a picture: one coloured box per cell, coloured by recipe, the recipe written inside.

matplotlib is imported only here, only when a picture is asked for (``memfit matrix --png PATH``).
The image is written to a temporary name and moved into place, so a half-written file never exists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memfit.errors import MemfitError
from memfit.plan.matrix import NO_FIT, Matrix

NO_FIT_COLOUR = "#d9d9d9"


def _seconds(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def saving_level(strategy: Any) -> tuple:
    """How much memory saving a recipe uses: sharding stage, then checkpointing, then offload."""
    stage = strategy.zero_stage or {"full_shard": 3, "shard_grad_op": 2}.get(strategy.fsdp or "", 0)
    offload = ("none", "optimizer", "optimizer+params").index(strategy.offload)
    return (stage + int(strategy.gradient_checkpointing), stage, offload, strategy.trains_adapter)


def draw(m: Matrix, path: str | Path, *, title: str | None = None, dpi: int = 110) -> Path:
    """Save the matrix as a PNG (or any format matplotlib infers from the suffix) at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    path = Path(path)
    if not path.suffix:
        raise MemfitError(f"--png {path}: give a file name with a suffix, e.g. matrix.png")
    rows = m.rows()
    level: dict[str, tuple] = {}
    for c in m.cells:
        if c.recommended is not None:
            level[c.label.split(" ×")[0]] = saving_level(c.recommended.strategy)
    recipes = sorted(level, key=lambda r: (level[r], r))  # light → dark as more memory-saving is needed
    cmap = plt.get_cmap("YlGnBu")
    n = max(len(recipes), 1)
    colours = {r: cmap(0.15 + 0.75 * i / max(n - 1, 1)) for i, r in enumerate(recipes)}

    n_rows, n_cols = len(m.models), len(m.seq_lens)
    fig, ax = plt.subplots(figsize=(1.6 * n_cols + 2.2, 0.75 * n_rows + 1.6))
    for i, row in enumerate(rows):
        for j, label in enumerate(row):
            cell = m.cell(m.models[i], m.seq_lens[j])
            recipe = label.split(" ×")[0]
            colour = colours.get(recipe, NO_FIT_COLOUR)
            y = n_rows - 1 - i
            ax.add_patch(Rectangle((j, y), 1, 1, facecolor=colour, edgecolor="white", linewidth=2))
            text = label.replace("+", "+\n", 1) if len(label) > 12 else label
            if cell.recommended is not None:
                text += f"\n{_seconds(cell.recommended.step_seconds)} s/step"
            r, g, b = colour[:3] if not isinstance(colour, str) else (0.85, 0.85, 0.85)
            dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.5
            ax.text(j + 0.5, y + 0.5, text, ha="center", va="center", fontsize=8,
                    color="white" if dark else ("black" if label != NO_FIT else "#555555"))
    ax.set_xlim(0, n_cols)
    ax.set_ylim(0, n_rows)
    ax.set_xticks([j + 0.5 for j in range(n_cols)], [str(s) for s in m.seq_lens])
    ax.set_yticks([n_rows - 1 - i + 0.5 for i in range(n_rows)], m.models)
    ax.set_xlabel("sequence length (tokens)")
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_title(title or f"Fastest recipe that fits on {m.hardware.text()}, predicted step time "
                          "(✗: none fits; ×2n: two nodes)", fontsize=10)
    handles = [Patch(facecolor=colours[r], label=r) for r in recipes]
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    fig.tight_layout()

    from memfit.io import atomic_file

    try:
        with atomic_file(path, "picture") as tmp:
            fig.savefig(tmp, dpi=dpi, format=path.suffix.lstrip(".") or "png")
    finally:
        plt.close(fig)
    return path
