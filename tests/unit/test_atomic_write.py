"""checkpoint.atomic_write / replace_dir, the one atomic-write path for checkpoints, exports,
metrics and batch dumps: the new content or the old, never a torn file, no temp left behind."""

import pytest

from checkpoint import atomic_write, replace_dir


def test_atomic_write_replaces_whole_or_not_at_all(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert atomic_write(path, lambda f: f.write(b"old\n")) == path

    def torn(f):
        f.write(b"half a li")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, torn)
    assert path.read_bytes() == b"old\n" and [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]
    atomic_write(path, lambda f: f.write(b"new\n"))
    assert path.read_bytes() == b"new\n" and [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_replace_dir_publishes_and_swaps_out_an_existing_dir(tmp_path):
    for content in ("first", "second"):
        tmp = tmp_path / ".out.tmp"
        tmp.mkdir()
        (tmp / "model.safetensors").write_text(content)
        replace_dir(tmp, tmp_path / "out")
        assert (tmp_path / "out" / "model.safetensors").read_text() == content
        assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp dir, no old copy
