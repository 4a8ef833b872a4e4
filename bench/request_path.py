"""The request path, measured: one non-streamed `POST /v1/completions` with an adapter on the built-in model,
served in this process, every call traced (sys.setprofile on the event loop's thread and the engine's), and
the hand-offs counted: distinct calls from a function in one file of loraplane_server into a function in
another, made while that request is served. docs/request-path.md walks them; issue 36's bound is at most 25
hand-offs over at most 15 files.

What counts: Python calls between two files of server/loraplane_server. What does not: calls into the shared
vocabulary's records and their methods (config, errors, sampling_params, sequence, detokenizer,
request_output: the data a request carries, read and updated everywhere), calls within one file, and calls
into torch, FastAPI or the C++ kernels (a kernel call is counted at its Python wrapper, kernels/cpu_kernels.py).

    python bench/request_path.py [--out FILE] [--edges]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "server" / "loraplane_server"
VOCABULARY = {"config.py", "errors.py", "sampling_params.py", "sequence.py", "detokenizer.py", "request_output.py"}


class Tracer:
    def __init__(self) -> None:
        self.on = False
        self.edges: dict[tuple[str, str, str, str], int] = {}
        self.lock = threading.Lock()

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:  # noqa: ANN401 - sys.setprofile's
        if not self.on or event != "call":
            return
        callee = frame.f_code
        caller_frame = frame.f_back
        if caller_frame is None:
            return
        callee_file, caller_file = Path(callee.co_filename), Path(caller_frame.f_code.co_filename)
        if not (_inside(callee_file) and _inside(caller_file)) or callee_file == caller_file:
            return
        if callee_file.relative_to(PACKAGE).as_posix() in VOCABULARY:
            return
        key = (_rel(caller_file), caller_frame.f_code.co_qualname, _rel(callee_file), callee.co_qualname)
        with self.lock:
            self.edges[key] = self.edges.get(key, 0) + 1


def _inside(path: Path) -> bool:
    return path.is_relative_to(PACKAGE)


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    parser.add_argument("--edges", action="store_true", help="print every hand-off")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "server"))
    from fastapi.testclient import TestClient

    from loraplane_server.config import EngineConfig
    from loraplane_server.serving.http.app import create_app
    from loraplane_server.serving.http.server_config import ServerConfig
    from loraplane_server.store.builtin import resolve_model

    model = resolve_model("smollm2-135m")
    adapters = ROOT / "server" / "examples" / "adapters"
    config = ServerConfig(engine=EngineConfig(model=str(model), adapter_dir=str(adapters)), log_level="warning")
    tracer = Tracer()
    threading.setprofile(tracer.profile)  # the engine's thread starts with the app, after this
    sys.setprofile(tracer.profile)
    body = {"model": "french", "prompt": "The capital of France is", "temperature": 0, "max_tokens": 8}
    with TestClient(create_app(config)) as client:
        for _ in range(600):  # the model loads in the background
            if client.get("/ready").status_code == 200:
                break
            time.sleep(0.5)
        warm = client.post("/v1/completions", json=body)  # the adapter's load, the kernels' first calls
        warm.raise_for_status()
        tracer.on = True
        answer = client.post("/v1/completions", json=body)
        tracer.on = False
    sys.setprofile(None)
    threading.setprofile(None)  # type: ignore[arg-type]
    answer.raise_for_status()
    edges = sorted(tracer.edges)
    files = sorted({f for e in edges for f in (e[0], e[2])})
    result = {
        "request": "POST /v1/completions, adapter french, 8 greedy tokens, not streamed",
        "hand_offs": len(edges),
        "files": len(files),
        "file_list": files,
        "edges": [f"{a}:{fa} -> {b}:{fb}" for a, fa, b, fb in edges],
    }
    if args.edges:
        for line in result["edges"]:
            print(line)
    print(json.dumps({k: v for k, v in result.items() if k != "edges"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
