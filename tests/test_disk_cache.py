"""DiskCache: byte budget, LRU order, pins, restart, hostile keys, failed fills, threads."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest

from loraplane_server.adapters.disk_cache import CacheFullError, DiskCache, entry_name


def filler(nbytes: int, marker: str = ""):
    def fill(dest: Path) -> None:
        (dest / "adapter_config.json").write_text(marker)
        (dest / "adapter_model.safetensors").write_bytes(b"\0" * (nbytes - len(marker.encode())))

    return fill


def entry_size(nbytes: int, key: str) -> int:
    return nbytes + len(key.encode())  # the files plus the stored key


def all_files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


def test_put_get_roundtrip(tmp_path):
    cache = DiskCache(tmp_path / "c", max_bytes=10_000)
    path = cache.put("org/a", filler(100, "hello"))
    assert (path / "adapter_config.json").read_text() == "hello"
    assert cache.get("org/a") == path
    assert cache.get("org/missing") is None
    assert cache.num_entries == 1
    assert cache.total_bytes == entry_size(100, "org/a") == cache.size_of("org/a")
    assert cache.keys() == ["org/a"]


def test_put_existing_key_does_not_refill(tmp_path):
    cache = DiskCache(tmp_path, max_bytes=10_000)
    first = cache.put("a", filler(100, "one"))

    def boom(dest: Path) -> None:
        raise AssertionError("fill called for a cached key")

    assert cache.put("a", boom) == first
    assert (first / "adapter_config.json").read_text() == "one"


def test_budget_never_exceeded(tmp_path):
    rng = random.Random(0)
    budget = 5_000
    cache = DiskCache(tmp_path, max_bytes=budget)
    for i in range(200):
        key = f"adapter-{rng.randrange(30)}"
        if rng.random() < 0.3:
            cache.get(key)
            continue
        cache.put(key, filler(rng.randrange(50, 1_500)))
        assert cache.total_bytes <= budget
        on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
        assert on_disk == cache.total_bytes, i
        assert cache.get(key) is not None  # the entry just put is never the one evicted


def test_lru_order_and_get_refreshes(tmp_path):
    size = entry_size(1000, "a")
    cache = DiskCache(tmp_path, max_bytes=3 * size)
    for key in "abc":
        cache.put(key, filler(1000))
    assert cache.keys() == ["a", "b", "c"]
    assert cache.get("a") is not None  # a becomes the most recent; b is now the oldest
    cache.put("d", filler(1000))
    assert cache.keys() == ["c", "a", "d"]
    assert cache.get("b") is None
    cache.put("e", filler(1000))
    assert cache.keys() == ["a", "d", "e"]


def test_pinned_never_evicted(tmp_path):
    size = entry_size(1000, "a")
    cache = DiskCache(tmp_path, max_bytes=3 * size)
    cache.put("a", filler(1000))
    cache.pin("a")
    for i in range(10):
        cache.put(f"k{i}", filler(1000))
        assert cache.get("a") is not None
        assert cache.total_bytes <= cache.max_bytes
    assert cache.is_pinned("a")
    cache.unpin("a")
    assert not cache.is_pinned("a")
    cache.put("x", filler(1000))
    cache.put("y", filler(1000))
    cache.put("z", filler(1000))
    assert "a" not in cache.keys()


def test_pins_are_counted(tmp_path):
    size = entry_size(1000, "a")
    cache = DiskCache(tmp_path, max_bytes=2 * size)
    cache.put("a", filler(1000))
    cache.pin("a")
    cache.pin("a")
    cache.unpin("a")
    cache.put("b", filler(1000))
    cache.put("c", filler(1000))
    assert "a" in cache.keys()
    with pytest.raises(KeyError):
        cache.pin("missing")
    cache.unpin("missing")  # no-op


def test_full_of_pins_raises_and_leaves_nothing(tmp_path):
    size = entry_size(1000, "a")
    cache = DiskCache(tmp_path, max_bytes=2 * size)
    cache.put("a", filler(1000))
    cache.put("b", filler(1000))
    cache.pin("a")
    cache.pin("b")
    before = all_files(tmp_path)
    with pytest.raises(CacheFullError, match="pinned"):
        cache.put("c", filler(1000))
    assert all_files(tmp_path) == before
    assert cache.keys() == ["a", "b"]


def test_entry_bigger_than_budget_raises_and_leaves_nothing(tmp_path):
    cache = DiskCache(tmp_path, max_bytes=1_000)
    cache.put("small", filler(100))
    before = all_files(tmp_path)
    with pytest.raises(ValueError, match="more than the whole disk cache"):
        cache.put("huge", filler(5_000))
    assert all_files(tmp_path) == before
    assert cache.keys() == ["small"]


def test_failing_fill_leaves_no_partial_entry(tmp_path):
    cache = DiskCache(tmp_path, max_bytes=10_000)

    def half(dest: Path) -> None:
        (dest / "adapter_config.json").write_text("{}")
        raise RuntimeError("network dropped")

    with pytest.raises(RuntimeError, match="network dropped"):
        cache.put("a", half)
    assert cache.get("a") is None
    assert list(tmp_path.iterdir()) == []
    assert cache.total_bytes == 0
    assert DiskCache(tmp_path, max_bytes=10_000).num_entries == 0


def test_restart_sees_entries_sizes_and_order(tmp_path):
    cache = DiskCache(tmp_path, max_bytes=10_000)
    for key, n in [("x", 100), ("y", 200), ("z", 300)]:
        cache.put(key, filler(n, key))
    cache.get("x")
    sizes = {k: cache.size_of(k) for k in cache.keys()}
    again = DiskCache(tmp_path, max_bytes=10_000)
    assert again.keys() == ["y", "z", "x"]
    assert {k: again.size_of(k) for k in again.keys()} == sizes
    assert again.total_bytes == cache.total_bytes
    assert (again.get("z") / "adapter_config.json").read_text() == "z"


def test_restart_with_smaller_budget_evicts_oldest(tmp_path):
    cache = DiskCache(tmp_path, max_bytes=10_000)
    for key in "abc":
        cache.put(key, filler(1000))
    smaller = DiskCache(tmp_path, max_bytes=2 * entry_size(1000, "a"))
    assert smaller.keys() == ["b", "c"]
    assert len(list(tmp_path.iterdir())) == 2


def test_restart_cleans_temp_dirs_and_ignores_foreign_files(tmp_path):
    DiskCache(tmp_path, max_bytes=10_000).put("a", filler(100))
    (tmp_path / ".tmp-crashed").mkdir()
    (tmp_path / ".tmp-crashed" / "junk").write_bytes(b"x" * 50)
    (tmp_path / "someone-elses-dir").mkdir()
    (tmp_path / "notes.txt").write_text("keep me")
    again = DiskCache(tmp_path, max_bytes=10_000)
    assert again.keys() == ["a"]
    assert not (tmp_path / ".tmp-crashed").exists()
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    assert (tmp_path / "someone-elses-dir").is_dir()


@pytest.mark.parametrize("key", ["../x", "/etc", "a/../../b", "..", ".", "~root", "a\\..\\..\\b", "x" * 5000, "é/\0/é"])
def test_hostile_keys_stay_inside_root(tmp_path, key):
    root = tmp_path / "cache"
    cache = DiskCache(root, max_bytes=100_000)
    path = cache.put(key, filler(10))
    assert Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root))
    assert path.parent.parent == root
    assert {p.name for p in tmp_path.iterdir()} == {"cache"}
    assert cache.get(key) == path
    assert DiskCache(root, max_bytes=100_000).keys() == [key]
    cache.remove(key)
    assert list(root.iterdir()) == []


def test_entry_names_are_distinct_and_safe():
    names = {entry_name(k) for k in ["a/b", "a_b", "a b", "A/B", "../a/b"]}
    assert len(names) == 5
    assert all("/" not in n and not n.startswith(".") and len(n) < 200 for n in names)


def test_remove(tmp_path):
    cache = DiskCache(tmp_path, max_bytes=10_000)
    cache.put("a", filler(100))
    cache.pin("a")
    cache.remove("a")
    assert cache.get("a") is None
    assert cache.total_bytes == 0
    assert list(tmp_path.iterdir()) == []
    cache.remove("a")  # no-op


def test_entry_deleted_behind_our_back_is_a_miss(tmp_path):
    cache = DiskCache(tmp_path, max_bytes=10_000)
    path = cache.put("a", filler(100))
    for p in sorted(path.parent.rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()
    path.parent.rmdir()
    assert cache.get("a") is None
    assert cache.total_bytes == 0


def test_concurrent_puts_and_gets(tmp_path):
    budget = 20_000
    cache = DiskCache(tmp_path, max_bytes=budget)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(60):
                key = f"k{rng.randrange(12)}"
                if rng.random() < 0.5:
                    path = cache.get(key)
                else:
                    path = cache.put(key, filler(rng.randrange(100, 3_000), key))
                assert path is None or path.name == "data"
                assert cache.total_bytes <= budget
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert cache.total_bytes <= budget
    on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    assert on_disk == cache.total_bytes
    assert sorted(DiskCache(tmp_path, max_bytes=budget).keys()) == sorted(cache.keys())


def test_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        DiskCache(tmp_path, max_bytes=0)
    with pytest.raises(ValueError):
        DiskCache(tmp_path, max_bytes=10).put("", filler(1))
