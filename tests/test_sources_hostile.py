"""Hostile remote adapter sources, served by a loopback HTTP server: redirects out of the allowlist,
redirect chains and loops, a tar bomb, bodies without or over their Content-Length. Each is refused
before it writes past the byte bound (the disk cache's room), leaves nothing behind, and harms no
other adapter; the last test does it all through a real `loraplane serve` on the built-in model."""

from __future__ import annotations

import functools
import http.server
import io
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

import httpx
import pytest
from test_http_support import ADMIN_TOKEN, REPO, ServerProcess, admin_headers
from test_sources import GOOD_MEMBERS, assert_good, tar_bytes

from loraplane_server.adapters.disk_cache import DiskCache
from loraplane_server.store.sources import MAX_REDIRECTS, AdapterSourceError, fetch, parse_source
from loraplane_server.store.sources.archive import extract_adapter
from loraplane_server.store.sources.budget import Budget

BOMB_BYTES = 200_000_000  # one member of zeros, about 200 KB once gzipped
STREAM_BYTES = 64 << 20  # what the endless bodies would send if read to the end
FRENCH = REPO / "server" / "examples" / "adapters" / "french"


class _Zeros(io.RawIOBase):
    def __init__(self, nbytes: int) -> None:
        self.left = nbytes

    def readable(self) -> bool:
        return True

    def readinto(self, buf: bytearray) -> int:  # type: ignore[override]
        n = min(len(buf), self.left)
        buf[:n] = bytes(n)
        self.left -= n
        return n


@functools.cache
def bomb(members: tuple[tuple[str, bytes], ...]) -> bytes:
    """A tar.gz of the given files and then 200 MB of zeros (honest headers: tar cannot lie about sizes)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("zeros")
        info.size = BOMB_BYTES
        tf.addfile(info, io.BufferedReader(_Zeros(BOMB_BYTES), 1 << 20))
    return buf.getvalue()


def french_members() -> tuple[tuple[str, bytes], ...]:
    return tuple((p.name, p.read_bytes()) for p in sorted(FRENCH.iterdir()) if p.is_file())


ARCHIVES = {
    "good.tar.gz": lambda: tar_bytes(GOOD_MEMBERS),
    "bomb.tar.gz": lambda: bomb(tuple(GOOD_MEMBERS)),
    "french.tar.gz": lambda: tar_bytes(list(french_members())),
    "french-bomb.tar.gz": lambda: bomb(french_members()),
}


class HostileHandler(http.server.BaseHTTPRequestHandler):
    """/<dir>/<archive> for any dir; /ok/redirect.tar.gz?to=<location>; /ok/chain/<n>.tar.gz (n -> n+1);
    /ok/pingpong-a.tar.gz <-> /ok/pingpong-b.tar.gz; /ok/no-length.tar.gz and /ok/huge-length.tar.gz send
    zeros until the client hangs up (the latter after Content-Length: STREAM_BYTES)."""

    def do_GET(self) -> None:  # noqa: N802
        self.server.paths.append(self.path)  # type: ignore[attr-defined]
        parts = urlsplit(self.path)
        name = parts.path.rsplit("/", 1)[-1]
        if parts.path == "/ok/redirect.tar.gz":
            self.redirect(parse_qs(parts.query)["to"][0])
        elif parts.path.startswith("/ok/chain/"):
            self.redirect(f"/ok/chain/{int(name.split('.')[0]) + 1}.tar.gz")
        elif name.startswith("pingpong-"):
            self.redirect("/ok/pingpong-b.tar.gz" if name == "pingpong-a.tar.gz" else "/ok/pingpong-a.tar.gz")
        elif name in ("no-length.tar.gz", "huge-length.tar.gz"):
            self.send_zeros(with_length=name == "huge-length.tar.gz")
        elif name in ARCHIVES:
            body = ARCHIVES[name]()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_error(404)

    def redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.end_headers()

    def send_zeros(self, with_length: bool) -> None:
        self.send_response(200)
        if with_length:
            self.send_header("Content-Length", str(STREAM_BYTES))
        self.end_headers()
        chunk = bytes(1 << 20)
        try:
            for _ in range(STREAM_BYTES // len(chunk)):
                self.wfile.write(chunk)
                self.server.sent[self.path] = self.server.sent.get(self.path, 0) + len(chunk)  # type: ignore[attr-defined]
        except OSError:
            pass  # the client hung up: what we want to see

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def site() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), HostileHandler)
    server.paths, server.sent = [], {}  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    thread.join()


@pytest.fixture
def base(site: http.server.ThreadingHTTPServer, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    site.paths.clear()  # type: ignore[attr-defined]
    site.sent.clear()  # type: ignore[attr-defined]
    return f"http://127.0.0.1:{site.server_address[1]}"


def bytes_written(pid: int | str = "self") -> int:
    """Bytes the process has passed to write(2) and friends, files and sockets alike (Linux)."""
    io_stats = Path(f"/proc/{pid}/io")
    if not io_stats.exists():
        pytest.skip("needs Linux's /proc/<pid>/io")
    return next(int(line.split()[1]) for line in io_stats.read_text().splitlines() if line.startswith("wchar:"))


# redirects


@pytest.mark.parametrize(
    "location",
    [
        "/notok/good.tar.gz",
        "/ok/../notok/good.tar.gz",
        "/ok/%2e%2e/notok/good.tar.gz",
        "http://localhost:{port}/ok/good.tar.gz",  # the same server, but not the allowed prefix
    ],
)
def test_a_redirect_out_of_the_allowlist_is_refused(
    site: http.server.ThreadingHTTPServer, base: str, tmp_path: Path, location: str
) -> None:
    url = f"{base}/ok/redirect.tar.gz?to={quote(location.format(port=site.server_address[1]))}"
    with pytest.raises(AdapterSourceError, match="--adapter-source-allow") as info:
        fetch(parse_source(url), tmp_path / "dest", allow=[f"{base}/ok/"])
    assert site.paths == [urlsplit(url).path + "?" + urlsplit(url).query]  # the target was never requested
    assert "127.0.0.1" not in info.value.public and "notok" not in info.value.public
    assert "--adapter-source-allow" in info.value.public
    assert list((tmp_path / "dest").iterdir()) == []


def test_a_redirect_within_the_allowlist_is_followed(
    site: http.server.ThreadingHTTPServer, base: str, tmp_path: Path
) -> None:
    url = f"{base}/ok/redirect.tar.gz?to=/ok/good.tar.gz"
    assert_good(fetch(parse_source(url), tmp_path / "dest", allow=[f"{base}/ok/"]))
    assert [p.split("?")[0] for p in site.paths] == ["/ok/redirect.tar.gz", "/ok/good.tar.gz"]


@pytest.mark.parametrize("start", ["chain/0.tar.gz", "pingpong-a.tar.gz"])
def test_redirects_are_bounded(site: http.server.ThreadingHTTPServer, base: str, tmp_path: Path, start: str) -> None:
    with pytest.raises(AdapterSourceError, match=f"redirected more than {MAX_REDIRECTS} times"):
        fetch(parse_source(f"{base}/ok/{start}"), tmp_path / "dest")
    assert len(site.paths) == MAX_REDIRECTS + 1  # urllib alone would follow up to 10


# the byte bound


def test_a_tar_bomb_is_refused_before_it_writes_past_the_bound(
    site: http.server.ThreadingHTTPServer, base: str, tmp_path: Path
) -> None:
    """200 MB of zeros in a 200 KB tar.gz, with a 1 MB bound: refused from its tar header, and this
    process writes (files and sockets alike) no more than the bound in all."""
    max_bytes = 1_000_000
    assert len(bomb(tuple(GOOD_MEMBERS))) < max_bytes // 2
    before = bytes_written()
    with pytest.raises(AdapterSourceError, match="archive unpacks to more than"):
        fetch(parse_source(f"{base}/ok/bomb.tar.gz"), tmp_path / "dest", max_bytes=max_bytes)
    assert bytes_written() - before <= max_bytes  # before: a 21 MB plain tar was written, then refused
    assert [p.name for p in tmp_path.iterdir()] == ["dest"] and list((tmp_path / "dest").iterdir()) == []
    assert_good(fetch(parse_source(f"{base}/ok/good.tar.gz"), tmp_path / "dest", max_bytes=max_bytes))


def test_the_archive_and_its_files_share_one_bound(base: str, tmp_path: Path) -> None:
    archive = len(ARCHIVES["good.tar.gz"]())
    files = sum(len(data) for _, data in GOOD_MEMBERS)
    with pytest.raises(AdapterSourceError, match="larger than|more than"):
        fetch(parse_source(f"{base}/ok/good.tar.gz"), tmp_path / "d1", max_bytes=archive + files - 1)
    assert_good(fetch(parse_source(f"{base}/ok/good.tar.gz"), tmp_path / "d2", max_bytes=archive + files))


def test_disk_cache_room_leaves_out_pinned_entries(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, max_bytes=10_000)
    cache.put("pinned", lambda d: (d / "f").write_bytes(bytes(3_000)))
    cache.pin("pinned")
    cache.put("loose", lambda d: (d / "f").write_bytes(bytes(3_000)))
    assert cache.room_for("new") == 10_000 - cache.size_of("pinned") - len("new")
    cache.unpin("pinned")
    assert cache.room_for("new") == 10_000 - len("new")  # unpinned entries can all be evicted


def test_a_gzip_header_bomb_is_refused_without_writing(tmp_path: Path) -> None:
    """A 40 MB GNU long name is never decompressed to disk, nor read into memory whole."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.GNU_FORMAT) as tf:
        tf.addfile(tarfile.TarInfo("a" * 40_000_000))
    archive = tmp_path / "dest" / ".download.tar.gz"
    archive.parent.mkdir()
    archive.write_bytes(buf.getvalue())
    before = bytes_written()
    with pytest.raises(AdapterSourceError, match=r"\(unpacked\) is larger than"):
        extract_adapter(archive, tmp_path / "dest", Budget(1_000_000), "bomb")
    assert bytes_written() - before < 1_000_000  # before: 21 MB of it went into a plain tar on disk
    assert [p.name for p in (tmp_path / "dest").iterdir()] == [".download.tar.gz"]


# through a real server


def wait_loaded(url: str, adapter_id: str, source: str, tier: str) -> dict:
    r = httpx.post(
        f"{url}/v1/adapters",
        json={"id": adapter_id, "source": source, "tier": tier, "wait": True, "timeout_s": 120},
        headers=admin_headers(),
        timeout=150,
    )
    assert r.status_code < 500, r.text
    deadline = time.monotonic() + 120
    while True:
        row = httpx.get(f"{url}/v1/adapters/{adapter_id}", headers=admin_headers(), timeout=30).json()
        if row["state"] in ("ready", "failed") or time.monotonic() > deadline:
            return row
        time.sleep(0.1)


def chat(url: str, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    r = httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 12, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_hostile_sources_through_a_real_server(
    site: http.server.ThreadingHTTPServer, base: str, smollm2_dir: Path, tmp_path: Path
) -> None:
    """--adapter-source-allow <base>/ok/, --disk-cache-bytes 3MiB: a redirect out of /ok/, a redirect loop,
    a tar bomb, an endless body without a length and one with a 64 MB length each fail with the reason,
    the server writes no more than the cache's size while refusing them, nothing stays in the cache
    directory, and the French adapter then loads from the same server and answers as it does from disk."""
    budget = 3 << 20
    cache_dir = tmp_path / "disk-cache"
    args = ["--max-model-len", "256", "--num-kv-blocks", "64", "--max-loras", "2", "--admin-token", ADMIN_TOKEN]
    args += ["--adapter-source-allow", f"{base}/ok/", "--disk-cache-bytes", str(budget)]
    args += ["--disk-cache-dir", str(cache_dir), "--adapter-dir", str(FRENCH.parent)]
    env = {"HF_HUB_OFFLINE": "1", "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    server = ServerProcess(args, tmp_path / "server.log", env=env)
    server.wait_ready()
    try:
        hostile = {
            "out": (f"/ok/redirect.tar.gz?to={quote('/notok/french.tar.gz')}", "--adapter-source-allow"),
            "loop": ("/ok/pingpong-a.tar.gz", f"more than {MAX_REDIRECTS} times"),
            "bomb": ("/ok/french-bomb.tar.gz", "archive unpacks to more than"),
            "nolength": ("/ok/no-length.tar.gz", f"larger than the {budget - len('nolength')} bytes"),
            "hugelength": ("/ok/huge-length.tar.gz", f"{STREAM_BYTES} bytes, more than"),
        }
        for adapter_id, (path, reason) in hostile.items():
            before = bytes_written(server.proc.pid)
            row = wait_loaded(server.url, adapter_id, f"{base}{path}", "disk")
            assert row["state"] == "failed" and reason in row["last_error"], (adapter_id, row)
            assert bytes_written(server.proc.pid) - before <= budget, adapter_id
        assert not any(urlsplit(p).path.startswith("/notok/") for p in site.paths)
        assert all(sent < STREAM_BYTES // 2 for sent in site.sent.values()), site.sent
        assert list(cache_dir.iterdir()) == []  # no entry, no .tmp-* left behind

        row = wait_loaded(server.url, "french-http", f"{base}/ok/french.tar.gz", "host")
        assert row["state"] == "ready", row
        answers = [chat(server.url, model) for model in ("french-http", "french")]  # remote, then --adapter-dir
        assert answers[0] == answers[1] and answers[0].strip(), answers
        assert [p.name for p in cache_dir.iterdir() if p.name.startswith(".tmp-")] == []
    finally:
        assert server.stop() == 0, server.log()
