"""Unpacking an adapter archive (.tar.gz, .tgz, .tar, .zip) with strict checks: every member checked before
anything is written, only the adapter files taken, decompressed data never on disk."""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import posixpath
import re
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from loraplane_server.store.sources.base import ADAPTER_FILES, CONFIG_FILE, AdapterSourceError
from loraplane_server.store.sources.budget import Budget, copy_stream, require_files

MAX_ARCHIVE_MEMBERS = 10_000
_TAR_OVERHEAD = 2048  # bytes of headers and padding allowed per tar member, beyond the file data


@dataclass(frozen=True)
class _Member:
    name: str  # normalised, relative
    size: int
    is_dir: bool
    ref: tarfile.TarInfo | zipfile.ZipInfo


def extract_adapter(archive: Path, dest: Path, budget: Budget, where: str) -> None:
    """Check every member of the archive, then write only the adapter files into dest, within budget."""
    try:
        if archive.name.endswith(".zip"):
            with zipfile.ZipFile(archive) as zf:
                files = _checked_members(_zip_members(zf, where), budget, where)
                _write_files(files, zf.open, dest, budget, where)  # type: ignore[arg-type]
        else:
            with _open_tar(archive, budget.limit, where) as tf:
                files = _checked_members(_tar_members(tf, where), budget, where)
                _write_files(files, tf.extractfile, dest, budget, where)  # type: ignore[arg-type]
    except (tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError) as exc:
        raise AdapterSourceError(f"{where}: cannot unpack the archive ({type(exc).__name__}: {exc})") from exc


@contextlib.contextmanager
def _open_tar(archive: Path, max_bytes: int, where: str) -> Iterator[tarfile.TarFile]:
    """A plain tar, or a .tar.gz decompressed as it is read (never to disk), capped so that neither data
    nor tar headers (a GNU long name is read into memory whole) can blow up."""
    if archive.name.endswith(".tar"):
        with tarfile.open(archive, "r:") as tf:  # "r:": no decompression without a cap
            yield tf
        return
    cap = max_bytes + _TAR_OVERHEAD * (MAX_ARCHIVE_MEMBERS + 2)
    with gzip.GzipFile(archive, "rb") as gz:
        capped = _CappedReader(gz, cap, where)
        with tarfile.open(fileobj=capped, mode="r:") as tf:  # type: ignore[call-overload]
            yield tf


class _CappedReader:
    """A seekable view of a decompressing stream that refuses to read or seek past `cap` bytes."""

    def __init__(self, raw: gzip.GzipFile, cap: int, where: str) -> None:
        self._raw, self._cap, self._where = raw, cap, where

    def _check(self, end: int) -> None:
        if end > self._cap:
            raise AdapterSourceError(
                f"{self._where} (unpacked) is larger than the {self._cap} bytes allowed",
                public=f"the adapter archive unpacks to more than the {self._cap} bytes allowed",
            )

    def read(self, size: int = -1, /) -> bytes:
        self._check(self._raw.tell() + (size if size >= 0 else self._cap + 1))
        return self._raw.read(size)

    def seek(self, offset: int, whence: int = os.SEEK_SET, /) -> int:
        if whence not in (os.SEEK_SET, os.SEEK_CUR):
            raise io.UnsupportedOperation("seek from the end of a compressed stream")
        target = offset + (self._raw.tell() if whence == os.SEEK_CUR else 0)
        self._check(target)
        return self._raw.seek(target)

    def tell(self) -> int:
        return self._raw.tell()


def _safe_name(raw: str, where: str) -> str:
    name = raw.replace("\\", "/")
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        raise AdapterSourceError(f"{where}: archive member {raw!r} has an absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise AdapterSourceError(f"{where}: archive member {raw!r} has a '..' path component")
    return "/".join(parts)


def _refuse_type(raw: str, is_link: bool, where: str) -> None:
    what = "link" if is_link else "special file"
    raise AdapterSourceError(
        f"{where}: archive member {raw!r} is a {what}; only plain files and directories are allowed"
    )


def _tar_members(tf: tarfile.TarFile, where: str) -> Iterator[_Member]:
    for info in tf:
        if not (info.isreg() or info.isdir()):
            _refuse_type(info.name, info.issym() or info.islnk(), where)
        yield _Member(_safe_name(info.name, where), info.size, info.isdir(), info)


def _zip_members(zf: zipfile.ZipFile, where: str) -> Iterator[_Member]:
    for info in zf.infolist():
        kind = stat.S_IFMT(info.external_attr >> 16)  # 0 when the writer recorded no file type
        if info.create_system == 3 and kind not in (0, stat.S_IFREG, stat.S_IFDIR):
            _refuse_type(info.filename, kind == stat.S_IFLNK, where)
        if info.flag_bits & 0x1:
            raise AdapterSourceError(f"{where}: archive member {info.filename!r} is encrypted")
        yield _Member(_safe_name(info.filename, where), info.file_size, info.is_dir(), info)


def _checked_members(members: Iterator[_Member], budget: Budget, where: str) -> dict[str, _Member]:
    """Check every member (count, declared sizes against what budget has left, names, types) before
    anything is written; return the plain files by name."""
    files: dict[str, _Member] = {}
    total = 0
    for count, member in enumerate(members, start=1):
        if count > MAX_ARCHIVE_MEMBERS:
            raise AdapterSourceError(f"{where}: archive has more than {MAX_ARCHIVE_MEMBERS} members")
        total += member.size
        budget.check(total, f"{where}: archive unpacks to more than the {budget.left} bytes left of {budget.limit}")
        if member.is_dir or not member.name:
            continue
        if member.name in files:
            raise AdapterSourceError(f"{where}: archive holds {member.name!r} more than once")
        files[member.name] = member
    return files


def _adapter_base(names: set[str], where: str) -> str:
    """The folder inside the archive that holds the adapter: the root, or its single top-level directory."""
    if CONFIG_FILE in names:
        return ""
    visible = {n for n in names if not n.startswith("__MACOSX/") and not posixpath.basename(n).startswith("._")}
    tops = {n.split("/", 1)[0] for n in visible}
    if len(tops) == 1 and all("/" in n for n in visible):
        return f"{tops.pop()}/"
    shown = ", ".join(sorted(names)[:8]) or "nothing"
    raise AdapterSourceError(
        f"{where}: expected {CONFIG_FILE} at the archive root or in one top-level directory; found {shown}"
    )


def _write_files(
    files: dict[str, _Member],
    open_member: Callable[[tarfile.TarInfo | zipfile.ZipInfo], IO[bytes]],
    dest: Path,
    budget: Budget,
    where: str,
) -> None:
    base = _adapter_base(set(files), where)
    inside = {n[len(base) :] for n in files if n.startswith(base) and "/" not in n[len(base) :]}
    require_files(inside, where)
    for name in ADAPTER_FILES:
        if name in inside:
            with open_member(files[base + name].ref) as src:
                copy_stream(src, dest / name, budget, where)
