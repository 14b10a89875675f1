"""The tests' compilation cache stays within its bound: pruning removes the oldest entries
first and keeps the newest that fit."""

import os

from tests.conftest import prune_cache


def test_pruning_removes_the_oldest_files_until_the_rest_fit(tmp_path):
    for i in range(6):
        f = tmp_path / ("sub" if i % 2 else ".") / f"entry{i}"
        f.parent.mkdir(exist_ok=True)
        f.write_bytes(b"x" * 100)
        os.utime(f, (1000 + i, 1000 + i))  # entry0 the oldest
    assert prune_cache(tmp_path, 350) == 3
    left = sorted(p.name for p in tmp_path.rglob("entry*"))
    assert left == ["entry3", "entry4", "entry5"]
    assert prune_cache(tmp_path, 350) == 0 and prune_cache(tmp_path / "none", 0) == 0
