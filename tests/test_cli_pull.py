"""`loraplane pull` (issue 37), the init container of vLLM server pods: real processes resolving a model into a
model cache as serve does, the --link a vLLM pod loads (relative inside the cache, swapped atomically), and a
failure whose last stderr line the operator reads as the reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_hf_cache import COMMIT, HF_ENV, REPO_ID, URI, write_hub_cache
from test_http_support import REPO

from loraplane_operator.server_status import failure_line
from loraplane_server.serving.cli import FAILURE_PREFIX

pytestmark = pytest.mark.slow

BUILTIN = "smollm2-135m"


def pull(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`loraplane pull ARGS` in a child process; env: added to this one's, less any hub-cache setting."""
    base = {k: v for k, v in os.environ.items() if k not in HF_ENV}
    cmd = [sys.executable, "-m", "loraplane_server.serving.cli", "pull", *args]
    return subprocess.run(cmd, cwd=REPO, env={**base, **(env or {})}, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def pulled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The built-in model pulled (converted from its GGUF) into a fresh model cache, linked at served/smollm2."""
    cache = tmp_path_factory.mktemp("pull") / "cache"
    done = pull("--model", BUILTIN, "--model-cache", str(cache), "--link", str(cache / "served" / "smollm2"))
    assert done.returncode == 0, done.stderr[-3000:]
    return cache, done


def test_pull_converts_the_builtin_and_links_it(pulled: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    cache, done = pulled
    model_dir = cache / BUILTIN
    assert done.stdout.strip().splitlines()[-1] == str(model_dir)  # the resolved directory, on stdout
    assert "model smollm2-135m: converting" in done.stderr  # serve's progress lines
    link = cache / "served" / "smollm2"
    assert link.is_symlink() and os.readlink(link) == os.path.join("..", BUILTIN)  # relative: inside the cache
    assert link.resolve() == model_dir.resolve() and (link / "config.json").is_file()
    names = {p.name for p in link.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert {"tokenizer_config.json", "chat_template.jinja"} <= names


def test_the_link_survives_moving_the_cache(pulled: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    """The volume mounted elsewhere (another container, another node): the link still finds the model."""
    cache, _ = pulled
    moved = cache.with_name("mounted-elsewhere")
    cache.rename(moved)
    try:
        link = moved / "served" / "smollm2"
        assert (link / "config.json").is_file()
        assert link.resolve() == (moved / BUILTIN).resolve()
    finally:
        moved.rename(cache)


def test_a_second_pull_replaces_the_link(pulled: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path) -> None:
    cache, _ = pulled
    link = cache / "served" / "smollm2"
    other = tmp_path / "elsewhere"  # a model directory outside the cache: linked by its absolute path
    other.mkdir()
    for p in (cache / BUILTIN).iterdir():
        os.link(p, other / p.name)
    done = pull("--model", str(other), "--model-cache", str(cache), "--link", str(link))
    assert done.returncode == 0, done.stderr[-3000:]
    assert os.readlink(link) == str(other) and done.stdout.strip() == str(other)
    done = pull("--model", BUILTIN, "--model-cache", str(cache), "--link", str(link))  # cached: nothing converted
    assert done.returncode == 0, done.stderr[-3000:]
    assert os.readlink(link) == os.path.join("..", BUILTIN) and "converting" not in done.stderr
    assert sorted(p.name for p in (cache / "served").iterdir()) == ["smollm2"]  # no temporary link left behind


def test_transformers_loads_the_linked_directory(pulled: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    """What vLLM reads of a model directory: the config, the tokenizer (with its chat template), every weight."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    link = pulled[0] / "served" / "smollm2"
    config = AutoConfig.from_pretrained(link)
    assert config.model_type == "llama" and config.num_hidden_layers == 30
    tokenizer = AutoTokenizer.from_pretrained(link)
    ids = tokenizer.encode("The capital of France is", add_special_tokens=False)
    assert tokenizer.decode(ids) == "The capital of France is" and max(ids) < config.vocab_size
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "hi" in chat and "user" in chat
    model, info = AutoModelForCausalLM.from_pretrained(link, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.config.vocab_size == config.vocab_size


def test_a_source_that_cannot_be_had_fails_with_the_reason(tmp_path: Path) -> None:
    cache, link = tmp_path / "cache", tmp_path / "cache" / "served" / "x"
    cases = [
        (["--model", "hf://org/absent", "--offline"], "hf://org/absent: not in the model cache"),
        (["--model", str(tmp_path / "no-such-model")], f"{str(tmp_path / 'no-such-model')!r} is neither a built-in"),
        (["--model", "s3://models/absent"], "s3://models/absent: not in the model cache"),
    ]
    for args, reason in cases:
        env = {"HF_HUB_OFFLINE": "1"} if "s3://" in args[1] else {}
        done = pull(*args, "--model-cache", str(cache), "--link", str(link), env=env)
        assert done.returncode == 1, done.stderr
        last = done.stderr.rstrip("\n").splitlines()[-1]
        assert last.startswith(FAILURE_PREFIX + reason), done.stderr[-3000:]
        assert failure_line(done.stderr) == last[len(FAILURE_PREFIX) :]  # as the operator reads it
        assert "Traceback" not in done.stderr and done.stdout == ""
        assert not os.path.lexists(link)


def test_a_directory_in_the_links_way_is_the_reason(
    pulled: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    cache, _ = pulled
    in_the_way = tmp_path / "served" / "x"
    (in_the_way / "a-file").parent.mkdir(parents=True)
    (in_the_way / "a-file").write_text("kept")
    done = pull("--model", BUILTIN, "--model-cache", str(cache), "--link", str(in_the_way))
    assert done.returncode == 1
    assert done.stderr.rstrip("\n").splitlines()[-1].startswith(f"{FAILURE_PREFIX}--link {in_the_way}: ")
    assert (in_the_way / "a-file").read_text() == "kept" and os.listdir(in_the_way.parent) == ["x"]


def test_an_hf_model_is_linked_in_the_hub_cache(smollm2_dir: Path, tmp_path: Path) -> None:
    """A vLLM pod's case: hf:// in <--model-cache>/hub, linked relatively. With HF_HOME set the hub cache lies
    outside the model cache: the link is absolute, and the pull warns that another container will not see it."""
    cache, home = tmp_path / "cache", tmp_path / "hf-home"
    snapshot = write_hub_cache(cache / "hub", REPO_ID, COMMIT, smollm2_dir)
    link = cache / "served" / "smollm2"
    done = pull("--model", URI, "--model-cache", str(cache), "--link", str(link), env={"HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(snapshot) and "warning" not in done.stderr
    assert os.readlink(link) == os.path.relpath(snapshot, link.parent) and (link / "config.json").is_file()

    elsewhere = write_hub_cache(home / "hub", REPO_ID, COMMIT, smollm2_dir)
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(home)}
    done = pull("--model", URI, "--model-cache", str(cache), "--link", str(link), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert os.readlink(link) == str(elsewhere) and f"warning: {elsewhere} lies outside the model cache" in done.stderr
