"""Adapter sources: parsing, allowlists, and fetching from a local dir, an offline HF cache, a loopback S3
(moto) and a loopback HTTP server serving good and hostile archives."""

from __future__ import annotations

import functools
import http.server
import io
import json
import os
import tarfile
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save

from loraplane_server.store.sources import AdapterSource, AdapterSourceError, fetch, is_allowed, parse_source
from loraplane_server.store.sources import archive as sources_archive
from loraplane_server.store.sources import s3 as sources_s3

CONFIG = json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}).encode()
WEIGHTS = save({"base_model.model.layers.0.self_attn.q_proj.lora_A.weight": np.ones((4, 8), np.float32)})
GOOD = {"adapter_config.json": CONFIG, "adapter_model.safetensors": WEIGHTS}


def write_tree(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_good(dest: Path, readme: bool = False) -> None:
    expected = dict(GOOD, **({"README.md": b"# hi"} if readme else {}))
    assert tree(dest) == expected


# parse


@pytest.mark.parametrize(
    ("uri", "fields"),
    [
        ("/data/adapters/a", {"kind": "local", "uri": "/data/adapters/a", "path": Path("/data/adapters/a")}),
        ("file:///data/a%20b", {"kind": "local", "path": Path("/data/a b")}),
        ("hf://org/repo", {"kind": "hf", "uri": "hf://org/repo", "repo_id": "org/repo", "revision": None}),
        ("hf://org/repo@v1.0", {"repo_id": "org/repo", "revision": "v1.0", "subfolder": ""}),
        ("hf://org/repo@abc123/sub/dir/", {"uri": "hf://org/repo@abc123/sub/dir", "subfolder": "sub/dir"}),
        ("hf://org/repo/sub", {"revision": None, "subfolder": "sub"}),
        ("s3://my-bucket/some/prefix/", {"kind": "s3", "uri": "s3://my-bucket/some/prefix", "prefix": "some/prefix"}),
        ("s3://my-bucket", {"bucket": "my-bucket", "prefix": ""}),
        ("HTTPS://Host.Example:8443/a/b.tar.gz", {"kind": "http", "uri": "https://host.example:8443/a/b.tar.gz"}),
        ("http://h/x.zip?sig=1", {"url": "http://h/x.zip?sig=1"}),
        ("http://h/x.TGZ", {"kind": "http"}),
    ],
)
def test_parse_source(uri, fields):
    source = parse_source(uri)
    for name, value in fields.items():
        assert getattr(source, name) == value, name


def test_parse_relative_local_path_is_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_source("adapters/a").path == tmp_path / "adapters" / "a"


@pytest.mark.parametrize(
    "uri",
    [
        "",
        "ftp://host/a.tar.gz",
        "hf://repo-only",
        "hf://org/repo@",
        "hf://org/repo/../other",
        "hf://../repo",
        "s3://Bad_Bucket/x",
        "s3://bucket/a/../b",
        "https://host/adapter",  # not an archive
        "https://host/dir/../x.tar.gz",
        "https://host/%2e%2e/x.tar.gz",
        "https://user:pw@host/x.tar.gz",
        "https:///x.tar.gz",
        "file://otherhost/x",
        "\x00",  # found by the HTTP fuzzer: a NUL made path checks raise ValueError (a 500)
        "/adapters/a\x00b",
        "hf://org/re\npo",
        "https://host/x\x7f.tar.gz",
        "~no-such-user-here/adapter",  # found by the fuzzer: expanduser raised RuntimeError (a 500)
    ],
)
def test_parse_rejects(uri):
    with pytest.raises(AdapterSourceError):
        parse_source(uri)


# allowlist


@pytest.mark.parametrize(
    ("uri", "allow", "ok"),
    [
        ("hf://org/repo", ["hf://"], True),
        ("hf://org/repo@v1", ["hf://org/repo"], True),
        ("hf://org/repo/sub", ["hf://org/repo"], True),
        ("hf://org/repo-evil", ["hf://org/repo"], False),
        ("hf://org/repo", ["hf://org/"], True),
        ("hf://other/repo", ["hf://org/"], False),
        ("s3://bucket/a", ["s3://bucket/"], True),
        ("s3://bucket/a", ["s3://bucket"], True),
        ("s3://bucket-2/a", ["s3://bucket"], False),
        ("s3://bucket/a", ["hf://", "https://"], False),
        ("https://host/x.tar.gz", ["https://host/"], True),
        ("https://host/x.tar.gz", ["HTTPS://host"], True),
        ("https://host.evil/x.tar.gz", ["https://host"], False),
        ("http://host/x.tar.gz", ["https://host/"], False),
        ("https://host/a/x.tar.gz", ["https://host/b/"], False),
        ("hf://org/repo", [], False),
        ("hf://org/repo", ["", "  "], False),
    ],
)
def test_is_allowed_prefixes(uri, allow, ok):
    assert is_allowed(parse_source(uri), allow) is ok


def test_is_allowed_local_dirs(tmp_path):
    allowed = tmp_path / "allowed"
    inside = write_tree(allowed / "a", GOOD)
    outside = write_tree(tmp_path / "outside", GOOD)
    (allowed / "link-out").symlink_to(outside)
    (allowed / "mixed").mkdir()
    (allowed / "mixed" / "adapter_config.json").write_bytes(CONFIG)
    (allowed / "mixed" / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    (tmp_path / "link-in").symlink_to(inside)
    assert is_allowed(parse_source(str(inside)), [str(allowed)])
    assert is_allowed(parse_source(str(inside)), [f"file://{allowed}"])
    assert is_allowed(parse_source(str(tmp_path / "link-in")), [str(allowed)])  # resolves inside
    assert not is_allowed(parse_source(str(outside)), [str(allowed)])
    assert not is_allowed(parse_source(str(allowed / "link-out")), [str(allowed)])
    assert not is_allowed(parse_source(str(allowed / "mixed")), [str(allowed)])
    assert not is_allowed(parse_source(str(allowed / ".." / "outside")), [str(allowed)])
    assert not is_allowed(parse_source(str(tmp_path / "allowed-2")), [str(allowed)])
    assert not is_allowed(parse_source("hf://org/repo"), [str(allowed)])
    assert not is_allowed(parse_source(str(inside)), ["hf://", "https://"])


# fetch: local


def test_fetch_local_copies_only_adapter_files(tmp_path):
    src = write_tree(tmp_path / "src", dict(GOOD, **{"README.md": b"# hi", "optimizer.pt": b"x", "sub/y": b"y"}))
    dest = fetch(parse_source(str(src)), tmp_path / "dest")
    assert dest == tmp_path / "dest"
    assert_good(dest, readme=True)


@pytest.mark.parametrize(
    ("files", "match"),
    [
        ({"adapter_model.safetensors": WEIGHTS}, "no adapter_config.json"),
        ({"adapter_config.json": CONFIG}, "no adapter_model.safetensors"),
        ({"adapter_config.json": CONFIG, "adapter_model.bin": b"pickle"}, "pickle"),
    ],
)
def test_fetch_local_missing_files(tmp_path, files, match):
    src = write_tree(tmp_path / "src", files)
    with pytest.raises(AdapterSourceError, match=match):
        fetch(parse_source(str(src)), tmp_path / "dest")
    assert list((tmp_path / "dest").iterdir()) == []


def test_fetch_local_errors(tmp_path):
    with pytest.raises(AdapterSourceError, match="does not exist"):
        fetch(parse_source(str(tmp_path / "nope")), tmp_path / "dest")
    src = write_tree(tmp_path / "src", GOOD)
    with pytest.raises(AdapterSourceError, match="allowed"):
        fetch(parse_source(str(src)), tmp_path / "dest", max_bytes=100)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(AdapterSourceError, match="not empty"):
        fetch(parse_source(str(src)), tmp_path / "full")


# fetch: hf, offline from a cache built on disk


def add_hf_repo(cache: Path, repo_id: str, commit: str, files: dict[str, bytes], ref: str | None = "main") -> None:
    """The layout huggingface_hub writes: blobs, snapshots/<commit>/<file> -> ../../blobs/<hash>, refs/<ref>."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    for name, data in files.items():
        blob = repo / "blobs" / f"{abs(hash((commit, name))):040x}"
        write_tree(blob.parent, {blob.name: data})
        link = repo / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref:
        write_tree(repo / "refs", {ref: commit.encode()})


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    c1, c2 = "a" * 40, "b" * 40
    add_hf_repo(cache, "org/adapter", c1, dict(GOOD, **{"README.md": b"# hi", "extra.bin": b"zz"}))
    add_hf_repo(cache, "org/adapter", c2, {"adapter_config.json": b"{}"}, ref="v2")
    add_hf_repo(cache, "org/multi", c1, {f"task/{k}": v for k, v in GOOD.items()})
    add_hf_repo(cache, "org/pickled", c1, {"adapter_config.json": CONFIG, "adapter_model.bin": b"pickle"})
    return cache


def test_fetch_hf_offline_from_cache(hf_cache, tmp_path):
    assert_good(fetch(parse_source("hf://org/adapter"), tmp_path / "d1"), readme=True)
    assert_good(fetch(parse_source(f"hf://org/adapter@{'a' * 40}"), tmp_path / "d2"), readme=True)
    assert_good(fetch(parse_source("hf://org/multi/task"), tmp_path / "d3"))
    with pytest.raises(AdapterSourceError, match="no adapter_model.safetensors"):
        fetch(parse_source("hf://org/adapter@v2"), tmp_path / "d4")


def test_fetch_hf_offline_refuses_pickle(hf_cache, tmp_path):
    with pytest.raises(AdapterSourceError, match="pickle"):
        fetch(parse_source("hf://org/pickled"), tmp_path / "d")


@pytest.mark.parametrize("uri", ["hf://org/not-cached", "hf://org/adapter@no-such-rev"])
def test_fetch_hf_offline_miss_explains(hf_cache, tmp_path, uri):
    miss = r"^hf://org/.*: not in the local Hugging Face cache and HF_HUB_OFFLINE is set"
    with pytest.raises(AdapterSourceError, match=miss) as info:
        fetch(parse_source(uri), tmp_path / "d")
    assert list((tmp_path / "d").iterdir()) == [] and not info.value.transient


def test_fetch_hf_errors_in_the_models_words(tmp_path, monkeypatch):
    """Online against a loopback Hub: adapters map huggingface_hub's failures as models do (hf_reason), and
    say whether trying again may help."""
    from hf_hub_server import HubServer
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # read at its import, maybe under hf_cache's "1"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    for name in ("HF_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    cases = {
        "hf://org/missing": (r"^hf://org/missing: repository not found \(check the repo id", False),
        "hf://org/adapter@v9": (r"^hf://org/adapter@v9: revision v9 not found$", False),
    }
    with HubServer() as hub:
        hub.add_repo("org/adapter").add_commit(GOOD)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        assert_good(fetch(parse_source("hf://org/adapter"), tmp_path / "good"))
        for uri, (match, transient) in cases.items():
            with pytest.raises(AdapterSourceError, match=match) as info:
                fetch(parse_source(uri), tmp_path / uri[len("hf://") :])
            assert info.value.transient is transient, uri
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens
    unreachable = r"^hf://org/other: cannot reach the Hub at http://127.0.0.1:9 "
    with pytest.raises(AdapterSourceError, match=unreachable) as info:
        fetch(parse_source("hf://org/other"), tmp_path / "dead")
    assert info.value.transient


# fetch: s3 against moto's server on loopback


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    pytest.importorskip("boto3", reason="boto3 is not installed")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint, monkeypatch) -> str:
    import boto3

    for name, value in [
        ("AWS_ENDPOINT_URL", s3_endpoint),
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
        ("NO_PROXY", "127.0.0.1,localhost"),
    ]:
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    bucket = "adapters"
    if bucket not in [b["Name"] for b in s3.list_buckets()["Buckets"]]:
        s3.create_bucket(Bucket=bucket)
        for key, data in {
            **{f"team/a/{k}": v for k, v in GOOD.items()},
            "team/a/README.md": b"# hi",
            "team/a/other.txt": b"not copied",
            **{f"team/pickled/{k}": v for k, v in {"adapter_config.json": CONFIG, "adapter_model.bin": b"p"}.items()},
            "team/noconfig/adapter_model.safetensors": WEIGHTS,
            **GOOD,
        }.items():
            s3.put_object(Bucket=bucket, Key=key, Body=data)
    return bucket


def test_fetch_s3(s3_bucket, tmp_path, monkeypatch):
    """One listing gives the files and their sizes: no HEAD per file, no head_bucket."""
    calls: list[str] = []
    real_client = sources_s3.s3_client

    def counted_client(*args, **kwargs):
        client = real_client(*args, **kwargs)
        client.meta.events.register("before-call.s3", lambda model, **_: calls.append(model.name))
        return client

    monkeypatch.setattr(sources_s3, "s3_client", counted_client)
    assert_good(fetch(parse_source(f"s3://{s3_bucket}/team/a/"), tmp_path / "d1"), readme=True)
    assert calls == ["ListObjectsV2"] + ["GetObject"] * 3
    assert_good(fetch(parse_source(f"s3://{s3_bucket}"), tmp_path / "d2"))


@pytest.mark.parametrize(
    ("path", "match"),
    [
        ("team/pickled", "pickle"),
        ("team/noconfig", "no adapter_config.json"),
        ("team/missing", "no adapter_config.json"),
    ],
)
def test_fetch_s3_missing_files(s3_bucket, tmp_path, path, match):
    with pytest.raises(AdapterSourceError, match=match):
        fetch(parse_source(f"s3://{s3_bucket}/{path}"), tmp_path / "d")
    assert list((tmp_path / "d").iterdir()) == []


def test_fetch_s3_errors(s3_bucket, tmp_path):
    with pytest.raises(AdapterSourceError, match="allowed"):
        fetch(parse_source(f"s3://{s3_bucket}/team/a"), tmp_path / "d1", max_bytes=50)
    assert list((tmp_path / "d1").iterdir()) == []
    with pytest.raises(AdapterSourceError, match=r"^s3://no-such-bucket/a: bucket does not exist at this") as info:
        fetch(parse_source("s3://no-such-bucket/a"), tmp_path / "d2")
    assert not info.value.transient and "no-such-bucket" not in info.value.public


def test_fetch_s3_unreachable_endpoint_hides_its_credentials(tmp_path, monkeypatch):
    """botocore's EndpointConnectionError quotes the endpoint URL, user:password included: neither the
    admin's text nor the public one may carry it, and the failure may pass (transient)."""
    pytest.importorskip("boto3", reason="boto3 is not installed")
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://admin:hunter2-secret@127.0.0.1:{closed}")
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with pytest.raises(AdapterSourceError) as info:
        fetch(parse_source("s3://bucket/a"), tmp_path / "d", timeout_s=2)
    assert "hunter2" in str(info.value.__cause__)  # what the old code put into the error
    texts = (str(info.value), info.value.public)
    assert all("hunter2" not in t and "admin:" not in t for t in texts), texts
    assert str(info.value).startswith(f"s3://bucket/a: cannot reach the S3 endpoint http://127.0.0.1:{closed} (")
    assert info.value.transient


def test_fetch_s3_without_boto3_explains(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_boto(name, *args, **kwargs):
        if name.split(".")[0] in ("boto3", "botocore"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_boto)
    with pytest.raises(AdapterSourceError, match=r"pip install 'loraplane\[s3\]'"):
        fetch(parse_source("s3://bucket/a"), tmp_path / "d")


# fetch: http archives from a loopback server


def tar_bytes(members: list[tarfile.TarInfo | tuple[str, bytes]], mode: str = "w:gz") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tf:
        for member in members:
            if isinstance(member, tarfile.TarInfo):
                tf.addfile(member)
            else:
                info = tarfile.TarInfo(member[0])
                info.size = len(member[1])
                tf.addfile(info, io.BytesIO(member[1]))
    return buf.getvalue()


def special(name: str, kind: bytes, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    return info


def zip_bytes(members: list[tuple[str, bytes]], symlink: tuple[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members:
            zf.writestr(name, data)
        if symlink:
            info = zipfile.ZipInfo(symlink[0])
            info.create_system = 3
            info.external_attr = 0o120777 << 16
            zf.writestr(info, symlink[1])
    return buf.getvalue()


GOOD_MEMBERS = list(GOOD.items())
ARCHIVES: dict[str, bytes] = {
    "root.tar.gz": tar_bytes(GOOD_MEMBERS + [("README.md", b"# hi"), ("optimizer.pt", b"x")]),
    "nested.tgz": tar_bytes([special("adapter", tarfile.DIRTYPE)] + [(f"adapter/{k}", v) for k, v in GOOD_MEMBERS]),
    "plain.tar": tar_bytes([(f"./{k}", v) for k, v in GOOD_MEMBERS], mode="w"),
    "good.zip": zip_bytes([(f"my-adapter/{k}", v) for k, v in GOOD_MEMBERS] + [("__MACOSX/._x", b"")]),
    "traversal.tar.gz": tar_bytes(GOOD_MEMBERS + [("../../escaped.txt", b"pwned")]),
    "absolute.tar.gz": tar_bytes(GOOD_MEMBERS + [("/tmp/loraplane-escaped.txt", b"pwned")]),
    "symlink.tar.gz": tar_bytes(
        [("adapter_config.json", CONFIG), special("adapter_model.safetensors", tarfile.SYMTYPE, "/etc/passwd")]
    ),
    "hardlink.tar.gz": tar_bytes(GOOD_MEMBERS + [special("link", tarfile.LNKTYPE, "/etc/passwd")]),
    "device.tar.gz": tar_bytes(GOOD_MEMBERS + [special("dev", tarfile.CHRTYPE)]),
    "fifo.tar": tar_bytes(GOOD_MEMBERS + [special("fifo", tarfile.FIFOTYPE)], mode="w"),
    "traversal.zip": zip_bytes(GOOD_MEMBERS + [("../escaped.txt", b"pwned")]),
    "symlink.zip": zip_bytes(GOOD_MEMBERS, symlink=("evil", "/etc/passwd")),
    "bomb.tar.gz": tar_bytes(GOOD_MEMBERS + [("zeros", b"\0" * 2_000_000)]),
    "bomb.zip": zip_bytes(GOOD_MEMBERS + [("zeros", b"\0" * 2_000_000)]),
    "notarchive.tar.gz": b"<html>this is not an archive</html>",
    "notarchive.zip": b"PK\x03\x04 garbage",
    "pickled.tar.gz": tar_bytes([("adapter_config.json", CONFIG), ("adapter_model.bin", b"pickle")]),
    "twodirs.tar.gz": tar_bytes([(f"a/{k}", v) for k, v in GOOD_MEMBERS] + [("b/x", b"x")]),
    "deep.tar.gz": tar_bytes([(f"a/b/{k}", v) for k, v in GOOD_MEMBERS]),
    "dupes.tar.gz": tar_bytes(GOOD_MEMBERS + [("adapter_config.json", b"{}")]),
    "many.tar.gz": tar_bytes(GOOD_MEMBERS + [(f"f{i}", b"") for i in range(30)]),
    "bzip2-inside.tar": tar_bytes(GOOD_MEMBERS, mode="w:bz2"),
}


@functools.cache
def header_bomb() -> bytes:
    """A tar.gz whose one GNU long-name header unpacks to 40 MB (tarfile would read it all into memory)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.GNU_FORMAT) as tf:
        tf.addfile(tarfile.TarInfo("a" * 40_000_000))
    return buf.getvalue()


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        name = self.path.lstrip("/").split("?")[0]
        if name == "redirect.tar.gz":
            self.send_response(302)
            self.send_header("Location", "/root.tar.gz")
            self.end_headers()
        elif name == "to-file.tar.gz":
            self.send_response(302)
            self.send_header("Location", "file:///etc/passwd")
            self.end_headers()
        elif name == "liar.tar.gz":  # no Content-Length, more bytes than allowed
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"\0" * 2_000_000)
        elif name in ARCHIVES or name == "header-bomb.tar.gz":
            body = header_bomb() if name == "header-bomb.tar.gz" else ARCHIVES[name]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_error(404)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def http_base() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


@pytest.fixture
def sandbox(tmp_path, monkeypatch) -> Path:
    """A directory whose only child is dest; hostile archives must leave it so."""
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dest").mkdir()
    return tmp_path


@pytest.mark.parametrize(
    ("name", "readme"),
    [
        ("root.tar.gz", True),
        ("nested.tgz", False),
        ("plain.tar", False),
        ("good.zip", False),
        ("redirect.tar.gz", True),
    ],
)
def test_fetch_http_good(http_base, sandbox, name, readme):
    dest = fetch(parse_source(f"{http_base}/{name}?token=abc"), sandbox / "dest")
    assert_good(dest, readme=readme)


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("traversal.tar.gz", r"'\.\.'"),
        ("absolute.tar.gz", "absolute"),
        ("symlink.tar.gz", "link"),
        ("hardlink.tar.gz", "link"),
        ("device.tar.gz", "special file"),
        ("fifo.tar", "special file"),
        ("traversal.zip", r"'\.\.'"),
        ("symlink.zip", "link"),
        ("bomb.tar.gz", "more than"),
        ("bomb.zip", "more than"),
        ("liar.tar.gz", "larger than"),
        ("header-bomb.tar.gz", r"\(unpacked\) is larger than"),
        ("bzip2-inside.tar", "cannot unpack"),
        ("notarchive.tar.gz", "cannot unpack"),
        ("notarchive.zip", "cannot unpack"),
        ("pickled.tar.gz", "pickle"),
        ("twodirs.tar.gz", "one top-level directory"),
        ("deep.tar.gz", "no adapter_config.json"),
        ("dupes.tar.gz", "more than once"),
        ("missing.tar.gz", "HTTP 404"),
        ("to-file.tar.gz", "(?i)redirect"),
    ],
)
def test_fetch_http_hostile(http_base, sandbox, name, match):
    with pytest.raises(AdapterSourceError, match=match):
        fetch(parse_source(f"{http_base}/{name}"), sandbox / "dest", max_bytes=1_000_000)
    assert [p.name for p in sandbox.iterdir()] == ["dest"]
    assert list((sandbox / "dest").iterdir()) == []
    assert not Path("/tmp/loraplane-escaped.txt").exists()
    assert not (sandbox.parent / "escaped.txt").exists()


def test_fetch_http_member_limit(http_base, sandbox, monkeypatch):
    monkeypatch.setattr(sources_archive, "MAX_ARCHIVE_MEMBERS", 10)
    with pytest.raises(AdapterSourceError, match="more than 10 members"):
        fetch(parse_source(f"{http_base}/many.tar.gz"), sandbox / "dest")
    monkeypatch.setattr(sources_archive, "MAX_ARCHIVE_MEMBERS", 100)
    assert_good(fetch(parse_source(f"{http_base}/many.tar.gz"), sandbox / "dest"))


def test_fetch_http_download_limit(http_base, sandbox):
    size = len(ARCHIVES["root.tar.gz"])
    with pytest.raises(AdapterSourceError, match=f"{size} bytes, more than"):
        fetch(parse_source(f"{http_base}/root.tar.gz"), sandbox / "dest", max_bytes=size - 1)


def test_fetch_http_unreachable(sandbox):
    with pytest.raises(AdapterSourceError, match="cannot download"):
        fetch(parse_source("http://127.0.0.1:9/x.tar.gz"), sandbox / "dest", timeout_s=5)


def test_fetch_unknown_kind_is_a_programming_error(tmp_path):
    with pytest.raises(KeyError):
        fetch(AdapterSource(kind="ftp", uri="ftp://x"), tmp_path / "d")
