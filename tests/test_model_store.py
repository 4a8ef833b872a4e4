"""The model cache (store/models/) with real parts: a MinIO server for s3://, a loopback Hub (hf_hub_server.py)
driven by the real huggingface_hub client for hf://, child processes killed halfway or racing on one cache."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import save_tiny
from engine_helpers import make_engine
from filelock import FileLock, Timeout
from hf_hub_server import HubServer, files_of
from s3_server import MinioServer, minio_server  # noqa: F401 - the session fixture
from safetensors.torch import load_file, save_file

from loraplane_server.config import EngineConfig
from loraplane_server.sampling_params import SamplingParams
from loraplane_server.serving.http import state as http_state
from loraplane_server.serving.http.server_config import ServerConfig
from loraplane_server.store import models as model_store
from loraplane_server.store.models import MANIFEST, Progress, resolve, verify
from loraplane_server.store.models import entry as store_entry
from loraplane_server.store.models import hf as store_hf
from loraplane_server.store.models import resolver as store_resolver
from loraplane_server.store.models import s3 as store_s3
from loraplane_server.store.sources import ModelSourceError, hf_reason, parse_source

DEAD_ENDPOINT = "http://127.0.0.1:9"  # nothing listens: any network call fails


class Recorder(Progress):
    """A Progress that remembers every phase it went through."""

    def __init__(self, source: str) -> None:
        super().__init__(source)
        self.phases: list[str] = []

    def set_phase(self, phase: str) -> None:
        self.phases.append(phase)
        super().set_phase(phase)


def shard(src: Path, dst: Path, num_shards: int = 2) -> Path:
    """src's single model.safetensors split into num_shards shards with an index (as max_shard_size does)."""
    dst.mkdir(parents=True)
    state = load_file(str(src / "model.safetensors"))
    names = sorted(state)
    weight_map = {}
    for i in range(num_shards):
        shard_name = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: state[n] for n in names[i::num_shards]}
        save_file(part, str(dst / shard_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard_name))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())}}
    (dst / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": weight_map}))
    for name in ("config.json", "generation_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small llama in two shards with an index."""
    src = save_tiny(tmp_path_factory.mktemp("tiny-src"), "llama")
    return shard(src, tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def big_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A llama with one ~8.5 MB shard: 9 chunks of the store's 1 MiB, enough to stop a download halfway."""
    return save_tiny(tmp_path_factory.mktemp("big"), "llama", vocab_size=8192, hidden_size=128, num_hidden_layers=1)


@pytest.fixture
def s3_env(minio_server: MinioServer, monkeypatch: pytest.MonkeyPatch) -> MinioServer:  # noqa: F811
    for name, value in minio_server.env().items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    return minio_server


def greedy_ids(model_dir: Path) -> list[list[int]]:
    engine = make_engine(model_dir, num_kv_blocks=16)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    return [out.token_ids for out in engine.generate([[1, 2, 3, 4], [7, 8]], params)]


class Killed(BaseException):
    """A process killed at this point: no except clause of the store's sees it."""


def damage(path: Path, how: str) -> None:
    """Damage a cached file in place (as a disk or a careless hand would: hard links see it too)."""
    if how == "delete":
        path.unlink()
    else:
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - 100)


# local directories and integrity


def test_local_directory_is_used_in_place_after_verifying(tiny_model: Path, tmp_path: Path) -> None:
    progress = Recorder(str(tiny_model))
    assert resolve(str(tiny_model), tmp_path / "cache", progress=progress) == tiny_model
    assert progress.phases == ["verifying", "loading"]
    assert not (tmp_path / "cache").exists()  # nothing copied


def corrupt_copy(tiny_model: Path, tmp_path: Path) -> Path:
    bad = tmp_path / "bad"
    bad.mkdir()
    for p in tiny_model.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    return bad


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        ("truncate", r"model-00002-of-00002.safetensors: corrupt safetensors file"),
        ("garbage", r"model-00001-of-00002.safetensors: corrupt safetensors file \(.*header"),
        ("drop_shard", r"model.safetensors.index.json: names shard model-00002-of-00002.safetensors, which is missing"),
        ("no_model_type", r"config.json: no model_type"),
        ("index_extra_tensor", r"names tensor ghost.weight in model-00001-of-00002.safetensors"),
    ],
)
def test_verify_names_the_broken_file(tiny_model: Path, tmp_path: Path, damage: str, match: str) -> None:
    bad = corrupt_copy(tiny_model, tmp_path)
    shard1, shard2 = bad / "model-00001-of-00002.safetensors", bad / "model-00002-of-00002.safetensors"
    if damage == "truncate":
        shard2.write_bytes(shard2.read_bytes()[:-100])
    elif damage == "garbage":
        shard1.write_bytes(b"\xff" * 64 + shard1.read_bytes()[64:])
    elif damage == "drop_shard":
        shard2.unlink()
    elif damage == "no_model_type":
        config = json.loads((bad / "config.json").read_text())
        del config["model_type"]
        (bad / "config.json").write_text(json.dumps(config))
    else:
        index = json.loads((bad / "model.safetensors.index.json").read_text())
        index["weight_map"]["ghost.weight"] = shard1.name
        (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelSourceError, match=match) as info:
        verify(bad)
    assert "delete it" not in str(info.value)  # nothing to delete: a cached copy is fetched again by itself
    if damage in ("truncate", "garbage"):
        assert str(info.value).startswith(str(bad / "model-0000"))  # the full path


def test_pickle_only_and_unknown_models_are_clear_errors(tmp_path: Path) -> None:
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text('{"model_type": "llama"}')
    (pickled / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ModelSourceError, match=r"only pickle weights \(pytorch_model.bin\).*safetensors"):
        resolve(str(pickled), tmp_path / "cache")
    with pytest.raises(ModelSourceError, match="neither a built-in model .*hf://org/repo"):
        resolve(str(tmp_path / "nope"), tmp_path / "cache")
    with pytest.raises(ModelSourceError, match="^--model ftp://host/model: unsupported .*scheme 'ftp'"):
        resolve("ftp://host/model", tmp_path / "cache")


# s3 on MinIO


def test_s3_downloads_only_model_files_then_reuses_and_works_offline(
    s3_env: MinioServer,
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    s3_env.upload_dir(tiny_model, "models", "team/tiny")
    s3 = s3_env.client()
    for key, body in [
        ("team/tiny/optimizer.pt", b"x"),
        ("team/tiny/sub/model.safetensors", b"y"),
        ("team/tiny/a.txt", b""),
    ]:
        s3.put_object(Bucket="models", Key=key, Body=body)
    cache, gets = tmp_path / "cache", s3_env.get_object_count()
    progress = Recorder("s3://models/team/tiny")
    with caplog.at_level(logging.INFO, logger="loraplane.model"):
        path = resolve("s3://models/team/tiny", cache, progress=progress)
    assert path == cache / "s3" / "models" / "team%2Ftiny"
    assert sorted(p.name for p in path.iterdir()) == sorted([MANIFEST, *(p.name for p in tiny_model.iterdir())])
    assert s3_env.get_object_count() - gets == 5  # config, generation config, index, two shards
    total = sum(p.stat().st_size for p in tiny_model.iterdir())
    assert progress.bytes_done == progress.bytes_total == progress.bytes_fetched == total
    assert progress.phases[:1] == ["downloading"] and progress.phases[-2:] == ["verifying", "loading"]
    assert any("(100%)" in r.getMessage() for r in caplog.records)  # log lines, not a terminal bar
    assert not path.with_name(path.name + ".partial").exists()
    assert greedy_ids(path) == greedy_ids(tiny_model)

    gets = s3_env.get_object_count()
    assert resolve("s3://models/team/tiny", cache) == path  # listed, the manifest matches: nothing fetched
    assert s3_env.get_object_count() == gets
    monkeypatch.setenv("AWS_ENDPOINT_URL", DEAD_ENDPOINT)
    assert resolve("s3://models/team/tiny", cache, offline=True) == path  # no S3 call at all


def test_s3_object_changed_is_downloaded_again(s3_env: MinioServer, tiny_model: Path, tmp_path: Path) -> None:
    s3_env.upload_dir(tiny_model, "models", "changing")
    cache = tmp_path / "cache"
    path = resolve("s3://models/changing", cache)
    config = json.loads((tiny_model / "config.json").read_text())
    config["note"] = "v2"
    s3_env.client().put_object(Bucket="models", Key="changing/config.json", Body=json.dumps(config).encode())
    gets = s3_env.get_object_count()
    assert resolve("s3://models/changing", cache) == path
    assert json.loads((path / "config.json").read_text())["note"] == "v2"
    assert s3_env.get_object_count() - gets == 1  # only the changed file


def test_s3_errors_say_what_to_fix(
    s3_env: MinioServer, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3_env.upload_dir(tiny_model, "models", "errs/good")
    s3 = s3_env.client()
    s3.put_object(Bucket="models", Key="errs/pickled/config.json", Body=b'{"model_type": "llama"}')
    s3.put_object(Bucket="models", Key="errs/pickled/pytorch_model.bin", Body=b"p")
    cache = tmp_path / "cache"
    cases = {
        "s3://models/errs/nope": r"^s3://models/errs/nope: no objects under this prefix \(expected config.json and",
        "s3://models/errs/pickled": r"only pickle weights \(pytorch_model.bin\)",
        "s3://no-such-bucket/x": r"^s3://no-such-bucket/x: bucket does not exist",
    }
    for uri, match in cases.items():
        with pytest.raises(ModelSourceError, match=match):
            resolve(uri, cache)
    with pytest.raises(ModelSourceError, match=r"^s3://models/errs/good: not in the model cache .* offline"):
        resolve("s3://models/errs/good", cache, offline=True)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value-1234")
    with pytest.raises(ModelSourceError, match=r"^s3://models/errs/good: access denied \(check the S3 credentials\)$"):
        resolve("s3://models/errs/good", cache)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://user:pw@127.0.0.1:9")
    with pytest.raises(ModelSourceError, match="cannot reach the S3 endpoint http://127.0.0.1:9 ") as info:
        resolve("s3://models/errs/good", cache)
    assert "pw" not in str(info.value)
    assert not (cache / "s3" / "models" / "errs%2Fgood").exists()


GPT2_CONFIG = json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}).encode()


def test_s3_unsupported_architecture_fails_before_the_shards_download(
    s3_env: MinioServer, tiny_model: Path, tmp_path: Path
) -> None:
    s3_env.upload_dir(tiny_model, "models", "gpt2")
    s3_env.client().put_object(Bucket="models", Key="gpt2/config.json", Body=GPT2_CONFIG)
    gets = s3_env.get_object_count()
    with pytest.raises(ModelSourceError, match=r"config.json: model_type 'gpt2' .*not supported; supported .*qwen3"):
        resolve("s3://models/gpt2", tmp_path / "cache")
    assert s3_env.get_object_count() - gets == 1  # config.json alone
    assert not list((tmp_path / "cache").rglob("*.safetensors*"))


def test_s3_corrupt_shard_is_never_used(s3_env: MinioServer, tiny_model: Path, tmp_path: Path) -> None:
    s3_env.upload_dir(tiny_model, "models", "corrupt")
    s3 = s3_env.client()
    good = (tiny_model / "model-00002-of-00002.safetensors").read_bytes()
    s3.put_object(Bucket="models", Key="corrupt/model-00002-of-00002.safetensors", Body=good[:-10])
    cache = tmp_path / "cache"
    with pytest.raises(ModelSourceError, match="model-00002-of-00002.safetensors: corrupt safetensors file"):
        resolve("s3://models/corrupt", cache)
    entry = cache / "s3" / "models" / "corrupt"
    assert not entry.exists() and entry.with_name("corrupt.partial").is_dir()  # never renamed into place
    with pytest.raises(ModelSourceError, match="not in the model cache"):
        resolve("s3://models/corrupt", cache, offline=True)  # a .partial is not an entry
    s3.put_object(Bucket="models", Key="corrupt/model-00002-of-00002.safetensors", Body=good)
    gets = s3_env.get_object_count()
    assert resolve("s3://models/corrupt", cache) == entry
    assert s3_env.get_object_count() - gets == 1  # only the replaced shard: the others were whole


@pytest.mark.parametrize("how", ["truncate", "delete"])
def test_s3_damaged_cached_shard_is_downloaded_again(
    s3_env: MinioServer, tiny_model: Path, tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    s3_env.upload_dir(tiny_model, "models", "damaged")
    cache = tmp_path / "cache"
    entry = resolve("s3://models/damaged", cache)
    shard2 = entry / "model-00002-of-00002.safetensors"
    damage(shard2, how)
    with pytest.raises(ModelSourceError, match=r"^s3://models/damaged: .*; start the server online to fetch it"):
        resolve("s3://models/damaged", cache, offline=True)
    gets, progress = s3_env.get_object_count(), Recorder("s3://models/damaged")
    with caplog.at_level(logging.WARNING, logger="loraplane.model"):
        assert resolve("s3://models/damaged", cache, progress=progress) == entry
    assert any(f"the cached copy in {entry} is damaged" in r.getMessage() for r in caplog.records)
    if how == "truncate":
        assert any(f"{shard2}: corrupt safetensors file" in r.getMessage() for r in caplog.records)
    assert s3_env.get_object_count() - gets == 5  # the whole entry again
    assert "downloading" in progress.phases and progress.phases[-1] == "loading"
    assert shard2.read_bytes() == (tiny_model / shard2.name).read_bytes()
    assert sorted(p.name for p in entry.parent.iterdir()) == ["damaged", "damaged.lock"]  # nothing left over
    assert resolve("s3://models/damaged", cache, offline=True) == entry


def test_s3_unservable_cached_entry_is_kept(s3_env: MinioServer, tiny_model: Path, tmp_path: Path) -> None:
    """A cached model this engine cannot serve (another version's cache) is an error, not damage to repair."""
    s3_env.upload_dir(tiny_model, "models", "kept")
    entry = resolve("s3://models/kept", tmp_path / "cache")
    (entry / "config.json").write_bytes(GPT2_CONFIG)
    gets = s3_env.get_object_count()
    with pytest.raises(ModelSourceError, match=r"config.json: model_type 'gpt2'"):
        resolve("s3://models/kept", tmp_path / "cache")
    assert s3_env.get_object_count() == gets and (entry / "model-00001-of-00002.safetensors").is_file()


def test_s3_killed_after_verifying_keeps_every_file(
    s3_env: MinioServer, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3_env.upload_dir(tiny_model, "models", "window")
    cache, synced = tmp_path / "cache", []
    real_replace, real_fsync = os.replace, getattr(store_s3, "_fsync", None)

    def replace(src: str | Path, dst: str | Path) -> None:
        if str(src).endswith(".partial"):
            raise Killed  # between the manifest and the rename into place
        real_replace(src, dst)

    with monkeypatch.context() as patch:
        patch.setattr(store_s3.os, "replace", replace)
        patch.setattr(store_s3, "_fsync", lambda path: synced.append(path.name) or real_fsync(path), raising=False)
        with pytest.raises(Killed):
            resolve("s3://models/window", cache)
    gets, progress = s3_env.get_object_count(), Progress("s3://models/window")
    entry = resolve("s3://models/window", cache, progress=progress)
    assert s3_env.get_object_count() == gets and progress.bytes_fetched == 0  # nothing downloaded again
    assert sorted(p.name for p in entry.iterdir()) == sorted([MANIFEST, *(p.name for p in tiny_model.iterdir())])
    assert sorted(synced) == sorted(f"{p.name}.part" for p in tiny_model.iterdir())  # each file, before it counts


class RangeIgnored:
    """An S3 client whose store ignores Range and always sends the whole object (with HTTP 200)."""

    def __init__(self, client: object) -> None:
        self._client = client

    def __getattr__(self, name: str) -> object:
        return getattr(self._client, name)

    def get_object(self, **kwargs: object) -> object:
        kwargs.pop("Range", None)
        return self._client.get_object(**kwargs)


def test_s3_store_that_ignores_range_restarts_the_file(
    s3_env: MinioServer, big_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3_env.upload_dir(big_model, "models", "norange")
    cache, real_copy = tmp_path / "cache", store_s3._copy_body

    def copy_one_chunk(body, out, progress) -> None:  # noqa: ANN001
        if not out.name.endswith("model.safetensors.part"):
            return real_copy(body, out, progress)
        out.write(body.read(store_s3._CHUNK))
        out.flush()
        raise Killed

    with monkeypatch.context() as patch:
        patch.setattr(store_s3, "_copy_body", copy_one_chunk)
        with pytest.raises(Killed):
            resolve("s3://models/norange", cache)
    part = cache / "s3" / "models" / "norange.partial" / "model.safetensors.part"
    assert part.stat().st_size == store_s3._CHUNK
    real_client = store_s3.s3_client
    monkeypatch.setattr(store_s3, "s3_client", lambda *args: RangeIgnored(real_client(*args)))
    progress = Progress("s3://models/norange")
    entry = resolve("s3://models/norange", cache, progress=progress)
    shard_bytes = (big_model / "model.safetensors").read_bytes()
    assert (entry / "model.safetensors").read_bytes() == shard_bytes  # not the object after its first MiB
    assert progress.bytes_fetched == len(shard_bytes) and progress.bytes_done == progress.bytes_total


CHILD = """
import json, sys
from pathlib import Path
from loraplane_server.store.models import Progress, resolve
phases = []
class Recorder(Progress):
    def set_phase(self, phase):
        phases.append(phase)
        super().set_phase(phase)
progress = Recorder(sys.argv[1])
path = resolve(sys.argv[1], Path(sys.argv[2]), progress=progress)
print(json.dumps({"path": str(path), "phases": phases, "fetched": progress.bytes_fetched}))
"""


def child(uri: str, cache: Path, env: dict[str, str], delay_s: float) -> subprocess.Popen[str]:
    env = {**os.environ, **env, "LORAPLANE_TEST_DOWNLOAD_DELAY_S": str(delay_s)}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, uri, str(cache)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(predicate, timeout_s: float = 60) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_s3_download_killed_halfway_resumes(s3_env: MinioServer, big_model: Path, tmp_path: Path) -> None:
    s3_env.upload_dir(big_model, "models", "big")
    cache, shard_size = tmp_path / "cache", (big_model / "model.safetensors").stat().st_size
    part = cache / "s3" / "models" / "big.partial" / "model.safetensors.part"
    proc = child("s3://models/big", cache, s3_env.env(), delay_s=0.3)
    wait_for(lambda: part.is_file() and part.stat().st_size >= 3 << 20)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kept = part.stat().st_size
    assert 0 < kept < shard_size
    assert not (cache / "s3" / "models" / "big").exists()

    sent, progress = s3_env.sent_bytes(), Progress("s3://models/big")
    path = resolve("s3://models/big", cache, progress=progress)
    assert progress.bytes_fetched == shard_size - kept  # the shard resumed where it stopped
    assert s3_env.sent_bytes() - sent < shard_size - kept + (1 << 16)  # MinIO agrees (plus headers)
    assert progress.bytes_done == progress.bytes_total
    assert load_file(str(path / "model.safetensors")).keys() == load_file(str(big_model / "model.safetensors")).keys()
    assert greedy_ids(path) == greedy_ids(big_model)


def test_two_processes_download_once(s3_env: MinioServer, big_model: Path, tmp_path: Path) -> None:
    s3_env.upload_dir(big_model, "models", "shared")
    cache, gets = tmp_path / "cache", s3_env.get_object_count()
    first = child("s3://models/shared", cache, s3_env.env(), delay_s=0.1)
    part = cache / "s3" / "models" / "shared.partial" / "model.safetensors.part"
    wait_for(lambda: part.is_file())  # the first holds the lock
    second = child("s3://models/shared", cache, s3_env.env(), delay_s=0.1)
    results = []
    for proc in (first, second):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out))
    assert results[0]["path"] == results[1]["path"] == str(cache / "s3" / "models" / "shared")
    assert s3_env.get_object_count() - gets == len(list(big_model.iterdir()))  # each file once
    assert "waiting" in results[1]["phases"] and results[1]["fetched"] == 0
    assert results[0]["fetched"] == sum(p.stat().st_size for p in big_model.iterdir())


# hf: the real huggingface_hub client against a loopback Hub, and offline from its cache layout


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tiny_model: Path) -> HubServer:
    with HubServer() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        for name in ("HF_TOKEN", "HF_HUB_OFFLINE"):
            monkeypatch.delenv(name, raising=False)
        files = files_of(tiny_model)
        repo = server.add_repo("org/tiny")
        repo.add_commit({**files, "pytorch_model.bin": b"never fetched", "sub/x.safetensors": b"nested"}, ("main",))
        config = json.loads(files["config.json"])
        repo.add_commit({**files, "config.json": json.dumps({**config, "note": "v1"}).encode()}, ("v1",))
        server.add_repo("org/private", token="hf_secret_token_value").add_commit(files)
        server.add_repo("org/pickled").add_commit({"config.json": files["config.json"], "pytorch_model.bin": b"p"})
        server.add_repo("org/gpt2").add_commit({**files, "config.json": GPT2_CONFIG})
        yield server


def test_hf_downloads_through_huggingface_hub(hub: HubServer, tiny_model: Path, tmp_path: Path) -> None:
    cache, progress = tmp_path / "cache", Recorder("hf://org/tiny")
    path = resolve("hf://org/tiny", cache, progress=progress)
    assert path.parent == cache / "hub" / "models--org--tiny" / "snapshots"
    assert sorted(p.name for p in path.iterdir()) == sorted(p.name for p in tiny_model.iterdir())
    assert progress.bytes_fetched == progress.bytes_total == sum(p.stat().st_size for p in tiny_model.iterdir())
    assert progress.phases[:1] == ["downloading"] and progress.phases[-2:] == ["verifying", "loading"]
    assert hub.count("GET", r"/resolve/.*pytorch_model.bin|/sub/") == 0
    assert greedy_ids(path) == greedy_ids(tiny_model)

    sent = hub.bytes_sent
    assert resolve("hf://org/tiny", cache) == path and hub.bytes_sent == sent  # cached: nothing downloaded
    v1 = resolve("hf://org/tiny@v1", cache)
    assert v1 != path and json.loads((v1 / "config.json").read_text())["note"] == "v1"


def test_hf_damaged_blob_is_downloaded_again(hub: HubServer, tiny_model: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    path = resolve("hf://org/tiny", cache)
    shard2 = path / "model-00002-of-00002.safetensors"
    damage(shard2.resolve(), "truncate")  # the blob the snapshot links to
    with pytest.raises(ModelSourceError, match=r"^hf://org/tiny: .*corrupt safetensors file.*fetch it again$"):
        resolve("hf://org/tiny", cache, offline=True)
    sent = hub.bytes_sent
    assert resolve("hf://org/tiny", cache) == path
    assert shard2.read_bytes() == (tiny_model / shard2.name).read_bytes()
    assert hub.bytes_sent - sent >= shard2.stat().st_size  # fetched again (force_download)


def test_hf_unexpected_error_keeps_its_scrubbed_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_value")
    exc = RuntimeError("proxy said no to hf_secret_token_value\n" + "x" * 1000)
    reason, transient = hf_reason(exc, parse_source("hf://org/tiny"), offline=False, not_cached="")
    assert reason.startswith("hf://org/tiny: download failed (RuntimeError: proxy said no to <HF_TOKEN> xxx")
    assert "hf_secret" not in reason and len(reason) < 400 and reason.endswith("...)")
    assert transient  # no answer from the Hub: may pass
    assert hf_reason(RuntimeError(), parse_source("hf://o/r"), False, "")[0].endswith("(RuntimeError)")


def test_hf_errors_say_what_to_fix(hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    cases = {
        "hf://org/missing": r"^hf://org/missing: repository not found \(check the repo id; a private repo needs",
        "hf://org/tiny@v9": r"^hf://org/tiny@v9: revision v9 not found$",
        "hf://org/private": r"^hf://org/private: repository not found .*HF_TOKEN",
        "hf://org/pickled": r"only pickle weights \(pytorch_model.bin\)",
    }
    for uri, match in cases.items():
        with pytest.raises(ModelSourceError, match=match):
            resolve(uri, cache)
    monkeypatch.setenv("HF_TOKEN", "hf_wrong_token_value")
    with pytest.raises(ModelSourceError, match="HF_TOKEN cannot read it") as info:
        resolve("hf://org/private", cache)
    assert "hf_wrong_token_value" not in str(info.value)
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_value")
    assert (resolve("hf://org/private", cache) / "config.json").is_file()
    monkeypatch.setenv("HF_ENDPOINT", DEAD_ENDPOINT)
    with pytest.raises(ModelSourceError, match=r"^hf://org/tiny: cannot reach the Hub at http://127.0.0.1:9"):
        resolve("hf://org/tiny", cache)


def test_hf_unsupported_architecture_fails_before_the_shards_download(hub: HubServer, tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match=r"config.json: model_type 'gpt2' .*not supported; supported .*qwen3"):
        resolve("hf://org/gpt2", tmp_path / "cache")
    assert hub.count("GET", r"/resolve/.*\.safetensors") == 0


def add_to_hub_cache(hub_dir: Path, repo_id: str, commit: str, files: dict[str, bytes], ref: str = "main") -> None:
    """The layout huggingface_hub writes: blobs/<etag>, snapshots/<commit>/<file> -> ../../blobs/<etag>, refs."""
    repo = hub_dir / f"models--{repo_id.replace('/', '--')}"
    for name, data in files.items():
        blob = repo / "blobs" / f"{abs(hash((commit, name))):040x}"
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)


def test_hf_offline_from_the_cache_layout(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", DEAD_ENDPOINT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "cache"
    add_to_hub_cache(cache / "hub", "org/cached", "c" * 40, files_of(tiny_model))
    path = resolve("hf://org/cached", cache)  # HF_HUB_OFFLINE alone means offline
    assert path == cache / "hub" / "models--org--cached" / "snapshots" / ("c" * 40)
    assert resolve(f"hf://org/cached@{'c' * 40}", cache, offline=True) == path
    with pytest.raises(ModelSourceError, match=r"^hf://org/other: not in the model cache .*offline"):
        resolve("hf://org/other", cache)


def test_progress_as_ready_reports_it() -> None:
    progress = Progress("s3://b/m")
    assert progress.as_dict()["phase"] == "resolving"  # not downloading: a local model never downloads
    progress.start(total=2000, done=500)
    progress.advance(500)
    assert progress.as_dict() == {"source": "s3://b/m", "phase": "downloading", "bytes_done": 1000, "bytes_total": 2000}
    assert progress.bytes_fetched == 500 and progress.describe().endswith("(50%)")


def test_engine_config_reaches_the_store(tiny_model: Path, tmp_path: Path) -> None:
    config = EngineConfig(model=str(tiny_model), model_cache=str(tmp_path / "c"), offline=True)
    listener = model_store.StartupListener(lambda _step: None, Recorder(str(tiny_model)))
    assert model_store.resolve_model(config, listener) == tiny_model
    assert listener.progress.phases[-1] == "loading"  # the listener's Progress is the one that moved


def test_converted_entry_damaged_is_converted_again(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A converted GGUF entry (the converter faked: the store's part is what happens around it)."""
    gguf, conversions = tmp_path / "tiny.Q8_0.gguf", []
    gguf.write_bytes(b"GGUF")

    def convert(path: Path, out: Path) -> None:
        conversions.append(path)
        tmp = out.with_name(out.name + ".tmp")
        tmp.mkdir(parents=True)
        for p in tiny_model.iterdir():
            (tmp / p.name).write_bytes(p.read_bytes())
        os.replace(tmp, out)

    monkeypatch.setattr(store_resolver, "convert_gguf", convert)
    cache = tmp_path / "cache"
    out = resolve(str(gguf), cache)
    assert resolve(str(gguf), cache) == out and len(conversions) == 1  # converted once
    damage(out / "model-00001-of-00002.safetensors", "truncate")
    progress = Recorder(str(gguf))
    assert resolve(str(gguf), cache, progress=progress) == out and len(conversions) == 2
    assert progress.phases == ["verifying", "converting", "verifying", "loading"]
    verify(out)
    (out / "config.json").write_bytes(GPT2_CONFIG)  # not damage: converting again would not help
    with pytest.raises(ModelSourceError, match=r"config.json: model_type 'gpt2'"):
        resolve(str(gguf), cache)
    assert len(conversions) == 2


def verified_under_lock(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """For each verify from now on: whether another process would find the entry's lock taken meanwhile."""
    held, real_verify = [], model_store.verify

    def verify_locked(path: Path, progress: Progress | None = None) -> None:
        other = FileLock(str(path.with_name(path.name.removesuffix(".partial") + ".lock")))
        try:
            other.acquire(timeout=0)
        except Timeout:
            held.append(True)
        else:
            other.release()
            held.append(False)
        real_verify(path, progress)

    for module in (store_entry, store_resolver, store_hf, store_s3):  # each looks verify up itself
        monkeypatch.setattr(module, "verify", verify_locked)
    return held


def test_cached_entries_are_verified_under_their_lock(
    s3_env: MinioServer, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "cache" / "gguf" / "x"
    shutil.copytree(tiny_model, out)
    held = verified_under_lock(monkeypatch)
    assert store_resolver._convert_once("x", lambda: tmp_path, out, Progress("x")) == out and held == [True]
    s3_env.upload_dir(tiny_model, "models", "locked")
    resolve("s3://models/locked", tmp_path / "cache")  # verified as .partial, under the lock
    resolve("s3://models/locked", tmp_path / "cache")  # verified as the cached entry
    assert held == [True, True, True]


def test_a_failed_start_logs_its_traceback_without_secrets(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-value-1234")

    def engine(*_args: object) -> None:
        raise RuntimeError("signed with aws-secret-value-1234")

    monkeypatch.setattr(http_state, "LLMEngine", engine)
    server = http_state.ServerState(ServerConfig())
    with caplog.at_level(logging.INFO, logger="loraplane.http"):
        asyncio.run(server.load())
    assert "aws-secret-value-1234" not in caplog.text
    assert "Traceback" in caplog.text and "RuntimeError: signed with <AWS_SECRET_ACCESS_KEY>" in caplog.text
    assert server.lifecycle.error == "RuntimeError: signed with <AWS_SECRET_ACCESS_KEY>"
