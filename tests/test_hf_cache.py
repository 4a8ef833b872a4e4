"""Issue 37: hf:// models live in the standard Hugging Face hub cache (HF_HUB_CACHE, else $HF_HOME/hub, else
<--model-cache>/hub, else huggingface_hub's default), so a model that huggingface-cli, transformers or vLLM
downloaded is served offline as it is. The cache here is written in huggingface_hub's own layout (checked by its
scan_cache_dir) from the built-in model's files, under SmolLM2-135M-Instruct's repo id."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from huggingface_hub import scan_cache_dir
from test_http_support import ServerProcess

from loraplane_server.config import EngineConfig
from loraplane_server.store.models import hub_cache, resolve, resolve_model
from loraplane_server.store.sources import ModelSourceError

REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
URI = f"hf://{REPO_ID}"
COMMIT = hashlib.sha1(b"loraplane test snapshot").hexdigest()  # a snapshot is named by its 40-hex commit
DEAD_ENDPOINT = "http://127.0.0.1:9"  # nothing listens: any network call would fail
HF_ENV = ("HF_HUB_CACHE", "HF_HOME", "LORAPLANE_MODEL_CACHE", "HF_ENDPOINT", "HF_HUB_OFFLINE", "XDG_CACHE_HOME")


def etag(path: Path) -> str:
    """The blob name huggingface_hub gives a file: the sha256 of an LFS file, git's blob sha1 of any other."""
    if path.suffix == ".safetensors":
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
        return digest.hexdigest()
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def write_hub_cache(hub: Path, repo_id: str, commit: str, model_dir: Path) -> Path:
    """The layout huggingface_hub writes: blobs/<etag>, snapshots/<commit>/<file> -> ../../blobs/<etag>, refs/main
    holding the commit. Blobs are hard links where the file system allows (the weights are 0.5 GB)."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for path in sorted(p for p in model_dir.iterdir() if p.is_file()):
        blob = repo / "blobs" / etag(path)
        try:
            os.link(path, blob)
        except OSError:
            shutil.copyfile(path, blob)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hf_home(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF_HOME whose hub/ holds SmolLM2-135M-Instruct (the built-in model's files) at COMMIT."""
    home = tmp_path_factory.mktemp("hf-home")
    write_hub_cache(home / "hub", REPO_ID, COMMIT, smollm2_dir)
    return home


@pytest.fixture
def offline_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No hub-cache setting from the machine running the tests; offline, and the Hub unreachable."""
    for name in HF_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", DEAD_ENDPOINT)
    return monkeypatch


def test_the_layout_is_what_huggingface_hub_scans(hf_home: Path, smollm2_dir: Path) -> None:
    info = scan_cache_dir(hf_home / "hub")
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert (repo.repo_id, repo.repo_type) == (REPO_ID, "model")
    (revision,) = repo.revisions
    assert revision.commit_hash == COMMIT and set(revision.refs) == {"main"}
    names = {p.name for p in smollm2_dir.iterdir() if p.is_file()}
    assert {f.file_name for f in revision.files} == names
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names


def test_hf_home_is_searched_before_the_model_cache(
    offline_env: pytest.MonkeyPatch, hf_home: Path, tmp_path: Path
) -> None:
    snapshot = hf_home / "hub" / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT
    offline_env.setenv("HF_HOME", str(hf_home))
    assert resolve(URI, tmp_path / "empty-cache") == snapshot  # HF_HUB_OFFLINE alone: offline
    assert resolve_model(EngineConfig(model=URI)) == snapshot
    assert resolve_model(EngineConfig(model=URI, model_cache=str(tmp_path / "c"))) == snapshot
    assert not (tmp_path / "empty-cache").exists() and not (tmp_path / "c").exists()


def test_hf_hub_cache_is_searched_first(offline_env: pytest.MonkeyPatch, hf_home: Path, tmp_path: Path) -> None:
    snapshot = hf_home / "hub" / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT
    offline_env.setenv("HF_HOME", str(tmp_path / "another-home"))  # HF_HUB_CACHE wins over it
    offline_env.setenv("HF_HUB_CACHE", str(hf_home / "hub"))
    assert resolve(URI, tmp_path / "cache") == snapshot
    assert resolve_model(EngineConfig(model=URI, model_cache=str(tmp_path / "cache"), offline=True)) == snapshot
    assert resolve(f"{URI}@{COMMIT}", tmp_path / "cache") == snapshot


def hub_cache_of_huggingface_hub(env: dict[str, str]) -> str:
    """huggingface_hub's own HF_HUB_CACHE constant in a fresh process (it reads the environment at import)."""
    code = "from huggingface_hub import constants; print(constants.HF_HUB_CACHE)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_the_hub_cache_is_huggingface_hubs_own(offline_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without --model-cache the hub cache is the one huggingface_hub (so vLLM and transformers) reads, whichever
    variable sets it; an explicit --model-cache is used only when neither HF_HUB_CACHE nor HF_HOME is set."""
    base = {k: v for k, v in os.environ.items() if k not in HF_ENV}
    base["HOME"] = str(tmp_path / "home")
    offline_env.setenv("HOME", base["HOME"])
    cases = [
        ({}, "huggingface_hub's default"),
        ({"XDG_CACHE_HOME": str(tmp_path / "xdg")}, "huggingface_hub's default"),
        ({"HF_HOME": str(tmp_path / "hf")}, "set by HF_HOME"),
        ({"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hub")}, "set by HF_HUB_CACHE"),
    ]
    for extra, origin in cases:
        for name in HF_ENV:
            offline_env.delenv(name, raising=False)
        for name, value in extra.items():
            offline_env.setenv(name, value)
        ours = hub_cache(None)
        assert (str(ours.path), ours.origin) == (hub_cache_of_huggingface_hub({**base, **extra}), origin), extra
        if "HF_HOME" in extra:
            assert hub_cache(tmp_path / "models") == ours  # the variables win over --model-cache
    for name in HF_ENV:
        offline_env.delenv(name, raising=False)
    assert hub_cache(tmp_path / "models").path == tmp_path / "models" / "hub"
    assert hub_cache(tmp_path / "models").origin == "under --model-cache"


def test_huggingface_hub_finds_the_snapshot_we_serve(offline_env: pytest.MonkeyPatch, hf_home: Path) -> None:
    """One copy for both engines: vLLM's snapshot_download(local_files_only) lands on the directory we resolve."""
    offline_env.setenv("HF_HOME", str(hf_home))
    code = f"import huggingface_hub as h; print(h.snapshot_download({REPO_ID!r}, local_files_only=True))"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True, text=True, check=True)
    assert Path(out.stdout.strip()) == resolve(URI, Path("/nonexistent-model-cache"))


def test_an_offline_miss_names_the_directory_searched(offline_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    offline_env.setenv("HF_HOME", str(tmp_path / "home"))
    with pytest.raises(ModelSourceError) as info:
        resolve("hf://org/absent", tmp_path / "cache")
    searched = tmp_path / "home" / "hub"
    assert str(info.value).startswith(
        f"hf://org/absent: not in the model cache ({searched}: the Hugging Face hub cache, set by HF_HOME) and the "
        "server is offline"
    ), info.value
    assert all(name in str(info.value) for name in ("HF_HUB_CACHE", "HF_HOME", "--model-cache"))
    offline_env.delenv("HF_HOME")
    searched = tmp_path / "cache" / "hub"
    with pytest.raises(ModelSourceError, match=rf"\({re.escape(str(searched))}: .*, under --model-cache\)"):
        resolve("hf://org/absent", tmp_path / "cache")
    with pytest.raises(ModelSourceError, match=r"huggingface/hub: .*, huggingface_hub's default\)"):
        resolve_model(EngineConfig(model="hf://org/absent"))


@pytest.mark.slow
def test_serve_answers_from_the_hf_home_cache(
    offline_env: pytest.MonkeyPatch, hf_home: Path, smollm2_dir: Path, tmp_path: Path
) -> None:
    """A real `loraplane serve --model hf://...` with only HF_HOME and HF_HUB_OFFLINE=1: it serves the cached
    snapshot, greedy text equal to transformers' on the same files."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "The capital of France is"
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    expected = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)

    offline_env.setenv("HF_HOME", str(hf_home))
    server = ServerProcess(["--host", "127.0.0.1", "--model", URI], tmp_path / "server.log")
    try:
        server.wait_ready()
        ready = httpx.get(f"{server.url}/ready", timeout=10).json()
        assert ready["model"]["source"] == URI and ready["model"]["phase"] == "ready", ready
        models = [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]]
        assert models[0] == REPO_ID, models  # named by its repo id, as vLLM names a Hub model
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": REPO_ID, "prompt": prompt, "max_tokens": 8, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == expected and expected.strip(), (body, expected)
        assert body["usage"]["completion_tokens"] == 8
    finally:
        assert server.stop() == 0, server.log()
    assert "downloading" not in server.log()
