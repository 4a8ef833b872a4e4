"""A real MinIO server on loopback for tests that need S3 (no tests here).

The binary is built from the Go module proxy by e2e/build_minio.sh into a cache outside the repo. Missing,
it is built when LORAPLANE_E2E_BUILD=1 (as `make test` sets), else the tests that need it are skipped with
the command that builds it. Prometheus metrics are public, so tests can count GetObject calls and bytes sent.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO / "e2e" / "build_minio.sh"
ACCESS_KEY = "loraplane-test"
SECRET_KEY = "loraplane-test-secret"
REGION = "us-east-1"


def minio_binary() -> Path:
    """The built binary; built now under LORAPLANE_E2E_BUILD=1, else the calling test is skipped."""
    path = Path(subprocess.check_output([str(BUILD_SCRIPT), "--print-bin"], text=True).strip())
    if path.is_file():
        return path
    if os.environ.get("LORAPLANE_E2E_BUILD") == "1":
        subprocess.run([str(BUILD_SCRIPT)], check=True)
        return path
    pytest.skip(f"MinIO is not built; build it once with {BUILD_SCRIPT.relative_to(REPO)} (or LORAPLANE_E2E_BUILD=1)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MinioServer:
    """`minio server` on 127.0.0.1:<free port> with a temporary data directory, as a context manager."""

    def __init__(self, binary: Path | None = None) -> None:
        self.binary = binary or minio_binary()
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.access_key, self.secret_key = ACCESS_KEY, SECRET_KEY
        self._dir = Path(tempfile.mkdtemp(prefix="loraplane-minio-"))
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> MinioServer:
        env = {
            **os.environ,
            "MINIO_ROOT_USER": self.access_key,
            "MINIO_ROOT_PASSWORD": self.secret_key,
            "MINIO_PROMETHEUS_AUTH_TYPE": "public",
            "MINIO_BROWSER": "off",
        }
        args = [str(self.binary), "server", str(self._dir / "data"), "--address", f"127.0.0.1:{self.port}"]
        args += ["--console-address", f"127.0.0.1:{_free_port()}", "--quiet"]
        with open(self._dir / "minio.log", "wb") as log:
            self._proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
        self._wait_live()
        return self

    def _wait_live(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"minio exited with {self._proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.endpoint}/minio/health/live", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"minio did not come up in {timeout_s} s:\n{self.log()}")

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def log(self) -> str:
        path = self._dir / "minio.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def env(self) -> dict[str, str]:
        """The AWS_* environment that points an AWS SDK (a child process) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "NO_PROXY": "127.0.0.1,localhost",
        }

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=REGION,
        )

    def upload_dir(self, local_dir: Path, bucket: str, prefix: str) -> list[str]:
        """Upload every file of local_dir (recursively) under bucket/prefix (bucket created if missing)."""
        s3 = self.client()
        if bucket not in [b["Name"] for b in s3.list_buckets()["Buckets"]]:
            s3.create_bucket(Bucket=bucket)
        keys = []
        for path in sorted(p for p in Path(local_dir).rglob("*") if p.is_file()):
            key = "/".join(filter(None, [prefix.strip("/"), path.relative_to(local_dir).as_posix()]))
            s3.upload_file(str(path), bucket, key)
            keys.append(key)
        return keys

    def _metrics(self) -> str:
        return httpx.get(f"{self.endpoint}/minio/metrics/v3/api/requests", timeout=10).text

    def _counter(self, pattern: str) -> int:
        return int(sum(float(v) for v in re.findall(pattern, self._metrics(), flags=re.MULTILINE)))

    def get_object_count(self) -> int:
        """GetObject requests served so far (answered with an error or not)."""
        return self._counter(r'^minio_api_requests_total\{name="GetObject"[^}]*\} (\S+)$')

    def sent_bytes(self) -> int:
        """Bytes this server has sent in answers to S3 requests (bodies and headers of every call)."""
        return self._counter(r"^minio_api_requests_traffic_sent_bytes\{[^}]*\} (\S+)$")


@pytest.fixture(scope="session")
def minio_server() -> Iterator[MinioServer]:
    with MinioServer() as server:
        yield server
