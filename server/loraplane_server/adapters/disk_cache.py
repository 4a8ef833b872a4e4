"""Local disk tier of the adapter cache: a byte-bounded LRU of adapter directories under one root.

Layout: root/<readable-prefix>--<sha256(key)>/{key, data/}; `data/` is the adapter directory handed
out, `key` holds the key so a restart can list the entries. Recency is the entry directory's mtime,
so a restart keeps the LRU order. New entries are filled in root/.tmp-* and renamed in atomically.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_KEY_FILE = "key"
_DATA_DIR = "data"
_TMP_PREFIX = ".tmp-"
_ENTRY_NAME = re.compile(r"^[A-Za-z0-9_.-]*--[0-9a-f]{64}$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


class CacheFullError(ValueError):
    """An entry that cannot fit in the disk cache; the message says what to change."""


@dataclass
class _Entry:
    name: str  # directory under root
    nbytes: int
    pins: int = 0


def entry_name(key: str) -> str:
    """A directory name for key that cannot escape the root: a readable prefix plus the key's sha256."""
    readable = _UNSAFE.sub("_", key).strip("._-")[:48]
    return f"{readable}--{hashlib.sha256(key.encode('utf-8', 'surrogatepass')).hexdigest()}"


def _tree_bytes(path: Path) -> int:
    """Bytes of the regular files under path (symlinks not followed)."""
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            st = os.lstat(os.path.join(dirpath, name))
            total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def _discard(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


class DiskCache:
    """Byte-bounded LRU of adapter directories under root; thread-safe.

    Pins are counted (each pin needs its own unpin) and kept in memory only; pinned entries are never
    evicted. Pin an entry while reading its files so that no eviction removes them underneath.
    """

    def __init__(self, root: Path, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"disk cache max_bytes must be positive, got {max_bytes}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._total = 0
        self.root.mkdir(parents=True, exist_ok=True)
        self._rebuild()

    # startup

    def _rebuild(self) -> None:
        found: list[tuple[float, str, _Entry]] = []
        for child in self.root.iterdir():
            if child.name.startswith(_TMP_PREFIX):
                shutil.rmtree(child, ignore_errors=True)  # left by a crash mid-put or mid-evict
            elif (read := self._read_entry(child)) is not None:
                found.append((child.stat().st_mtime, *read))
        for _, key, entry in sorted(found, key=lambda t: (t[0], t[2].name)):
            self._entries[key] = entry
            self._total += entry.nbytes
        _discard(self._evict(keep=None))

    def _read_entry(self, path: Path) -> tuple[str, _Entry] | None:
        """(key, entry) for a well-formed entry directory; None for anything else, which is left alone."""
        if not _ENTRY_NAME.match(path.name) or path.is_symlink() or not (path / _DATA_DIR).is_dir():
            return None
        try:
            key = (path / _KEY_FILE).read_bytes().decode("utf-8", "surrogatepass")
        except (OSError, UnicodeDecodeError):
            return None
        if entry_name(key) != path.name:
            return None
        return key, _Entry(path.name, _tree_bytes(path))

    # lookups

    def get(self, key: str) -> Path | None:
        """The adapter directory for key, refreshed as most recently used; None on a miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if not (self.root / entry.name / _DATA_DIR).is_dir():  # removed behind our back
                self._forget(key)
                return None
            self._touch(key, entry)
            return self.root / entry.name / _DATA_DIR

    def keys(self) -> list[str]:
        """Cached keys, least recently used first."""
        with self._lock:
            return list(self._entries)

    def size_of(self, key: str) -> int | None:
        """Bytes held by key's entry, or None if it is not cached."""
        with self._lock:
            entry = self._entries.get(key)
            return entry.nbytes if entry else None

    def is_pinned(self, key: str) -> bool:
        with self._lock:
            entry = self._entries.get(key)
            return bool(entry and entry.pins)

    def room_for(self, key: str) -> int:
        """The most bytes a new entry for key may fill and still be committed: max_bytes less the pinned
        entries (never evicted) and the stored key. A fetch bounded by it never writes past the cache."""
        with self._lock:
            pinned = sum(e.nbytes for e in self._entries.values() if e.pins)
        return self.max_bytes - pinned - len(key.encode("utf-8", "surrogatepass"))

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return self._total

    @property
    def num_entries(self) -> int:
        with self._lock:
            return len(self._entries)

    # updates

    def put(self, key: str, fill: Callable[[Path], None]) -> Path:
        """Cache key's adapter: fill() writes it into an empty directory, which is then renamed in.

        If key is already cached, fill is not called (or its result is dropped, if another thread won
        the race) and the cached directory is returned. Evicts least recently used unpinned entries,
        never this one, to stay within max_bytes; raises CacheFullError, leaving nothing, if it cannot.
        """
        if not key:
            raise ValueError("disk cache key must be a non-empty string")
        if (hit := self.get(key)) is not None:
            return hit
        tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=self.root))
        try:
            (tmp / _DATA_DIR).mkdir()
            fill(tmp / _DATA_DIR)
            (tmp / _KEY_FILE).write_bytes(key.encode("utf-8", "surrogatepass"))
            return self._commit(key, tmp, _tree_bytes(tmp))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already when committed

    def _commit(self, key: str, tmp: Path, nbytes: int) -> Path:
        name = entry_name(key)
        with self._lock:
            if key in self._entries:
                self._touch(key, self._entries[key])
                return self.root / name / _DATA_DIR
            pinned = sum(e.nbytes for e in self._entries.values() if e.pins)
            if nbytes > self.max_bytes - pinned:
                raise CacheFullError(self._full_message(key, nbytes, pinned))
            trash = [self._to_trash(name)]  # a stray directory of that name, not in the index
            os.rename(tmp, self.root / name)
            entry = _Entry(name, nbytes)
            self._entries[key] = entry
            self._total += nbytes
            self._touch(key, entry)
            trash += self._evict(keep=key)
        _discard(trash)
        return self.root / name / _DATA_DIR

    def _full_message(self, key: str, nbytes: int, pinned: int) -> str:
        if nbytes > self.max_bytes:
            return f"adapter {key!r} takes {nbytes} bytes, more than the whole disk cache ({self.max_bytes} bytes)"
        return (
            f"adapter {key!r} takes {nbytes} bytes, but pinned adapters hold {pinned} of the disk cache's "
            f"{self.max_bytes} bytes; unpin some or enlarge the cache"
        )

    def remove(self, key: str) -> None:
        """Drop key's entry and its files (even if pinned); a missing key is a no-op."""
        with self._lock:
            trash = [self._delete(key)] if key in self._entries else []
        _discard(trash)

    def pin(self, key: str) -> None:
        """Protect key's entry from eviction until a matching unpin; KeyError if it is not cached."""
        with self._lock:
            if key not in self._entries:
                raise KeyError(f"adapter {key!r} is not in the disk cache")
            self._entries[key].pins += 1

    def unpin(self, key: str) -> None:
        """Undo one pin; a missing or unpinned key is a no-op."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.pins:
                entry.pins -= 1

    # internals, called with the lock held

    def _touch(self, key: str, entry: _Entry) -> None:
        self._entries.move_to_end(key)
        now = time.time()
        try:
            os.utime(self.root / entry.name, (now, now))
        except OSError:
            pass  # recency survives in memory; only restart order suffers

    def _evict(self, keep: str | None) -> list[Path]:
        """Drop least recently used unpinned entries until within budget; return the trash to discard."""
        trash: list[Path] = []
        for key in list(self._entries):
            if self._total <= self.max_bytes:
                break
            if key != keep and not self._entries[key].pins:
                trash.append(self._delete(key))
        return trash

    def _delete(self, key: str) -> Path:
        return self._to_trash(self._forget(key).name)

    def _to_trash(self, name: str) -> Path:
        """Move root/name out of sight at once (rename); the caller deletes the returned dir unlocked."""
        trash = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=self.root))
        try:
            os.rename(self.root / name, trash / name)
        except FileNotFoundError:
            pass
        return trash

    def _forget(self, key: str) -> _Entry:
        entry = self._entries.pop(key)
        self._total -= entry.nbytes
        return entry
