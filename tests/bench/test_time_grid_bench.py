"""bench/time_grid.py's bookkeeping: groups in grid order, the run's profile as the median of every
calibration it took, Kendall's tau (no measuring here)."""

import json
from pathlib import Path

import pytest

from bench import time_grid as tg

from memfit.spec import hwprofile


def test_groups_in_grid_order():
    groups = tg.groups_of(tg.CELLS)
    assert list(groups) == ["llama-256", "llama-1024", "qwen2-128", "qwen2-512"]
    assert groups["llama-1024"] == [8, 9, 10, 11]
    assert tg.groups_of(tg.CELLS, only=[1, 13, 14]) == {"llama-256": [1], "qwen2-128": [13, 14]}


def test_kendall_tau_hand_computed():
    assert tg.kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert tg.kendall_tau([1, 2, 3, 4], [20, 10, 30, 40]) == pytest.approx(4 / 6)  # one pair of six swapped


def _group_profile(path: Path, op_seconds: list[float], bandwidth: list[float]) -> None:
    """A group window's saved profile: its calibrations (the history) and their merged figures."""
    from tests.steptime.test_time_model import rates

    history = [{k: getattr(rates(op_seconds=o, bandwidth={"1": b}), k) for k in hwprofile.MEASURED}
               | {"measured_unix": 1000.0 + i} for i, (o, b) in enumerate(zip(op_seconds, bandwidth))]
    merged = rates(op_seconds=op_seconds[-1], bandwidth={"1": bandwidth[-1]}, history=history)
    path.write_text(json.dumps(merged.to_dict()))


def test_window_profile_is_the_median_of_every_calibration(tmp_path):
    _group_profile(tmp_path / "profile-a-1.json", [1e-5, 3e-5], [1e10, 2e10])
    _group_profile(tmp_path / "profile-b-2.json", [2e-5, 9e-5], [4e10, 8e10])
    saved = hwprofile.HardwareRates.from_dict(json.loads(tg.window_profile(tmp_path).read_text()))
    assert saved.op_seconds == pytest.approx(2.5e-5)  # median of 1, 3, 2, 9 (x 1e-5)
    assert saved.bandwidth["1"] == pytest.approx(3e10)  # median of 1, 2, 4, 8 (x 1e10)
    assert len(saved.history) == 4


def test_held_out_draw_is_deterministic_for_a_seed():
    from bench import time_grid_heldout as ho

    assert ho.draw(8, seed=0) == ho.draw(8, seed=0)
    assert ho.draw(8, seed=0) != ho.draw(8, seed=1)
    shapes, cells = ho.draw(8, seed=0)
    assert len(cells) == 8 and len(shapes) == 2  # two groups of four, as the development grid's groups
    assert ho.draw(5, seed=0)[1] == cells[:5]  # a smaller draw is a prefix of a larger one


@pytest.mark.parametrize("seed", range(20))
def test_held_out_never_yields_a_development_configuration(seed):
    from bench import time_grid_heldout as ho

    shapes, cells = ho.draw(8, seed=seed)
    dev_shapes = {ho._shape_key(s) for s in tg.SHAPES.values()}
    dev_seqs = {c["seq_len"] for c in tg.CELLS}
    for cell in cells:
        shape = shapes[cell["model"]]
        assert ho._shape_key(shape) not in dev_shapes and cell["seq_len"] not in dev_seqs
        assert shape["hidden_size"] not in {s["hidden_size"] for s in tg.SHAPES.values()}
        assert shape["num_hidden_layers"] not in {s["num_hidden_layers"] for s in tg.SHAPES.values()}
        assert (ho._shape_key(shape), cell["seq_len"]) not in ho.dev_keys(tg.SHAPES, tg.CELLS)
        assert cell["model"] not in tg.SHAPES and cell not in tg.CELLS
        assert ho.work(cell, shape) <= ho.MAX_WORK
        # a model memfit can build and train: heads divide the width, kv heads the heads, an even head dim
        assert shape["hidden_size"] % shape["num_attention_heads"] == 0
        assert shape["num_attention_heads"] % shape["num_key_value_heads"] == 0
        assert (shape["hidden_size"] // shape["num_attention_heads"]) % 2 == 0
        assert cell["nproc"] in (1, 2) and (cell["method"] != "qlora" or cell["nproc"] == 1)
        assert not (cell.get("zero_stage") or cell.get("fsdp")) or (cell["method"] == "full" and cell["nproc"] == 2)
    # within a group one shape and one sequence length (the configurations ranked against each other)
    groups = tg.groups_of(cells)
    assert all(len({cells[i]["seq_len"] for i in idx}) == 1 for idx in groups.values())


def test_held_out_configurations_make_runs():
    from bench import time_grid_heldout as ho

    shapes, cells = ho.draw(8, seed=0)
    models = {name: Path("/nonexistent") / name for name in shapes}
    for cell in cells:
        run = tg.make_run(cell, models)
        assert run.strategy.seq_len == cell["seq_len"] and run.distributed.nproc == cell["nproc"]
