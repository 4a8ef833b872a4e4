"""The operator image stays slim: `operator/requirements.txt` is all it installs besides the loraplane package
(`pip install --no-deps .`), `loraplane operator` and every operator module import with nothing else than those
distributions, their dependencies and the standard library, and what pip would install for them is measured here
from the installed distributions' own file lists (no Docker engine on this machine to build the image)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "operator" / "requirements.txt"
OPERATOR_MODULES = sorted(
    p.stem for p in (ROOT / "operator" / "loraplane_operator").glob("*.py") if p.stem != "__init__"
)
SIZE_LIMIT_MB = 60  # the operator's own dependencies; torch's CPU wheel alone is ~180 MB installed


def requirements() -> list[Requirement]:
    lines = [line.split("#")[0].strip() for line in REQUIREMENTS.read_text().splitlines()]
    return [Requirement(line) for line in lines if line]


def closure(names: list[str]) -> set[str]:
    """The distributions pip installs for `names`: each with its unconditional dependencies, recursively (the
    markers evaluated for this Python, extras left out)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        seen.add(name)
        for spec in metadata.requires(name) or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def top_level_modules(dists: set[str]) -> set[str]:
    by_module = metadata.packages_distributions()
    norm = {module: {re.sub(r"[-_.]+", "-", d).lower() for d in ds} for module, ds in by_module.items()}
    return {module for module, ds in norm.items() if ds & dists}


def test_requirements_match_the_package_bounds():
    """Each operator requirement is a dependency of the package with the same bound (one source of truth in
    spirit: pyproject's list is what `pip install .` gets; the image gets this subset)."""
    import tomllib

    declared = {Requirement(r).name.lower(): str(Requirement(r).specifier) for r in tomllib.loads(
        (ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}  # fmt: skip
    for req in requirements():
        assert declared.get(req.name.lower()) == str(req.specifier), req


def slim_site(dists: set[str], into: Path) -> Path:
    """A site directory holding only `dists` (links to their installed top-level files, metadata included) and the
    two loraplane packages from this checkout: what the image's site-packages holds."""
    into.mkdir()
    for name in dists:
        dist = metadata.distribution(name)
        for top in {f.parts[0] for f in dist.files or [] if not f.parts[0].startswith("..")}:
            target = Path(str(dist.locate_file(top)))
            if target.exists() and not (into / top).exists():
                (into / top).symlink_to(target)
    for package in (ROOT / "server" / "loraplane_server", ROOT / "operator" / "loraplane_operator"):
        (into / package.name).symlink_to(package)
    return into


def test_the_operator_starts_with_only_its_requirements(tmp_path):
    """Every operator module and `loraplane operator --help` import in a Python that sees only the requirements'
    closure and the standard library (-S: no site-packages); torch, numpy and transformers are not there to load."""
    site = slim_site(closure([r.name for r in requirements()]), tmp_path / "site")
    script = textwrap.dedent(
        f"""
        import importlib, json, sys
        for module in {OPERATOR_MODULES!r}:
            importlib.import_module("loraplane_operator." + module)
        from loraplane_server.serving.cli import main
        try:
            main(["operator", "--help"])
        except SystemExit as exit:
            assert exit.code == 0, exit.code
        absent = []
        for heavy in ("torch", "numpy", "transformers", "fastapi"):
            try:
                importlib.import_module(heavy)
            except ImportError:
                absent.append(heavy)
        print(json.dumps({{"absent": absent, "path": sys.path}}))
        """
    )
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    p = subprocess.run([sys.executable, "-S", "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(p.stdout.strip().splitlines()[-1])
    assert report["absent"] == ["torch", "numpy", "transformers", "fastapi"], report  # truly not there
    assert not [entry for entry in report["path"] if "site-packages" in entry], report["path"]


def test_the_operator_dependencies_are_small():
    dists = closure([r.name for r in requirements()])
    assert not {"torch", "numpy", "transformers", "nvidia-cublas-cu12"} & dists, dists
    total = 0
    for name in dists:
        dist = metadata.distribution(name)
        total += sum((f.size or 0) for f in dist.files or [])
    megabytes = total / 2**20
    print(f"operator image dependencies: {len(dists)} distributions, {megabytes:.1f} MB installed")
    assert 1 < megabytes < SIZE_LIMIT_MB, (megabytes, sorted(dists))


def test_the_operator_image_installs_no_torch():
    text = (ROOT / "Dockerfile.operator").read_text()
    runs = " ".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "torch" not in runs and "pip install --no-deps ." in runs
    assert "pip install -r operator/requirements.txt" in runs
