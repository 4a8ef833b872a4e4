"""The byte budget of one adapter fetch, and the copies that spend it: each chunk counted before it is written."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from loraplane_server.store.sources.base import ADAPTER_FILES, ADAPTER_FILESET, PICKLE_FILE, AdapterSourceError

_CHUNK = 1 << 20


class Budget:
    """The bytes one fetch may still write; each write is counted before it happens."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.left = limit

    def check(self, nbytes: int, message: str) -> None:
        """Refuse (AdapterSourceError with message) if nbytes would not fit."""
        if nbytes > self.left:
            public = f"the adapter source is larger than the {self.limit} bytes this server allows for an adapter"
            raise AdapterSourceError(message, public=public)

    def take(self, nbytes: int, message: str) -> None:
        """Count nbytes about to be written, or refuse them if they would not fit."""
        self.check(nbytes, message)
        self.left -= nbytes


@dataclass(frozen=True)
class Limits:
    budget: Budget
    timeout_s: float
    allow: tuple[str, ...] | None  # None: redirects are checked for their scheme only


def require_files(names: set[str], where: str) -> None:
    ADAPTER_FILESET.check(names, where)


def check_total(sizes: list[int], budget: Budget, where: str) -> None:
    total = sum(sizes)
    budget.check(total, f"{where} holds {total} bytes of adapter files, over the {budget.left} allowed")


class _Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


def copy_stream(src: _Readable, dst: Path, budget: Budget, where: str) -> None:
    """Copy src into the new file dst, each chunk counted against budget before it is written."""
    with open(dst, "xb") as out:
        while chunk := src.read(_CHUNK):
            budget.take(len(chunk), f"{where} is larger than the {budget.limit} bytes allowed")
            out.write(chunk)


def copy_local_tree(src: Path, dest: Path, budget: Budget, where: str) -> None:
    present = [n for n in ADAPTER_FILES if (src / n).is_file()]
    require_files(set(present) | ({PICKLE_FILE} if (src / PICKLE_FILE).exists() else set()), where)
    check_total([(src / n).stat().st_size for n in present], budget, where)
    for name in present:
        with open(src / name, "rb") as f:
            copy_stream(f, dest / name, budget, where)  # counted: a file may grow after its stat
