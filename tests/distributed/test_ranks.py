"""memfit.distributed.ranks: who this process is, and leaving the process group at the end of the work."""

import pytest

from memfit.distributed import ranks


def test_single_process_without_a_launcher(monkeypatch):
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert ranks.rank_info() == (0, 0, 1) and ranks.is_main_process()
    assert ranks.launched_world() == (1, 1)
    ranks.finish()  # nothing to leave: no error


def test_launcher_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ranks.rank_info() == (3, 1, 4) and not ranks.is_main_process()
    assert ranks.launched_world() == (4, 2)


def test_finish_leaves_the_process_group():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch without torch.distributed")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert ranks.rank_info()[2] == 1
    ranks.finish()
    assert not dist.is_initialized()
