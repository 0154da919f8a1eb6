"""memfit.io: results are written whole, with umask permissions, and OS failures are one line."""

import errno
import os
import stat

import pytest

from memfit.io import WriteError, atomic_dir, atomic_file, make_dir, write_json, write_text


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(p):
    return stat.S_IMODE(os.stat(p).st_mode)


def test_files_and_folders_get_umask_permissions(tmp_path, umask022):
    assert mode(write_text(tmp_path / "a" / "run.yaml", "x: 1\n")) == 0o644
    assert mode(write_json(tmp_path / "summary.json", {"a": 1})) == 0o644
    with atomic_dir(tmp_path / "adapter") as tmp:
        (tmp / "sub").mkdir(mode=0o700)
        (tmp / "sub" / "w.safetensors").write_bytes(b"x")
        os.chmod(tmp / "sub" / "w.safetensors", 0o600)
    assert mode(tmp_path / "adapter") == 0o755
    assert mode(tmp_path / "adapter" / "sub") == 0o755
    assert mode(tmp_path / "adapter" / "sub" / "w.safetensors") == 0o644
    os.umask(0o077)
    assert mode(write_text(tmp_path / "private.txt", "x")) == 0o600  # the user's umask is obeyed


def test_disk_full_is_one_line_and_leaves_nothing(tmp_path):
    write_text(tmp_path / "metrics.jsonl", "old\n")
    with pytest.raises(WriteError, match=r"^cannot write metrics .*metrics.jsonl: no space left on device$"):
        with atomic_file(tmp_path / "metrics.jsonl", "metrics"):
            raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(WriteError, match="no space left on device"):
        with atomic_dir(tmp_path / "adapter"):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temp leftovers
    assert (tmp_path / "metrics.jsonl").read_text() == "old\n"  # the previous file is kept


def test_a_file_where_a_folder_belongs(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(WriteError, match="it is a file, not a folder"):
        make_dir(tmp_path / "f", "output_dir")
    with pytest.raises(WriteError, match="a part of the path is a file, not a folder"):
        write_text(tmp_path / "f" / "g" / "run.yaml", "x")


def test_read_only_file_system_is_one_line(tmp_path, monkeypatch):
    from pathlib import Path

    def rofs(self, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "mkdir", rofs)
    with pytest.raises(WriteError, match=r"^cannot write output_dir .*/run: read-only file system$"):
        make_dir(tmp_path / "run", "output_dir")


def test_metrics_on_a_full_disk_is_one_line():
    from types import SimpleNamespace

    pytest.importorskip("transformers")
    from memfit.train.callbacks import MetricsWriter

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    state = SimpleNamespace(is_world_process_zero=True, global_step=3)
    with pytest.raises(WriteError, match=r"^cannot write metrics /dev/full: no space left on device$"):
        MetricsWriter("/dev/full").on_log(None, state, None, logs={"loss": 1.0})
