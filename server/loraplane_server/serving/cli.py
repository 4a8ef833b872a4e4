"""The `loraplane` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import uuid
from pathlib import Path

from loraplane_server.config import EngineConfig, check_device_name
from loraplane_server.sampling_params import SamplingParams

# the last stderr line of a start that failed (serve, chat, pull): the operator reads the reason after it from
# a pod's termination message (operator/loraplane_operator/constants.py holds the same string)
FAILURE_PREFIX = "loraplane: failed to start: "


def _model_args(p: argparse.ArgumentParser) -> None:
    """The model's source and cache: one set of flags for serve, chat and pull, so they resolve alike."""
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="built-in model name, a Hugging Face model directory, a .gguf file, hf://org/repo[@revision] "
        "(token: $HF_TOKEN) or s3://bucket/prefix (endpoint, region and credentials as the AWS SDK reads them)",
    )
    p.add_argument(
        "--model-cache",
        default=os.environ.get("LORAPLANE_MODEL_CACHE") or None,
        metavar="DIR",
        help="where downloaded and converted models live, shared safely by several processes "
        "(default: $LORAPLANE_MODEL_CACHE, else <user cache>/loraplane/models); hf:// models go to the "
        "Hugging Face hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else DIR/hub when this is given, else "
        "~/.cache/huggingface/hub",
    )
    p.add_argument(
        "--offline",
        action="store_true",
        default=_env_flag("HF_HUB_OFFLINE"),
        help="use the model cache only, never download (default: on when HF_HUB_OFFLINE=1)",
    )


def _engine_args(p: argparse.ArgumentParser) -> None:
    _model_args(p)
    p.add_argument(
        "--device",
        default="auto",
        type=_device_name,
        help="auto (default: CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N; a CUDA device that "
        "cannot serve (no CUDA build of torch, no GPU visible, a driver that does not answer) fails the start "
        "with the reason, never falls back to the CPU",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="F",
        help="CUDA: the fraction of the GPU's memory this server takes (default 0.9): the weights and a profiled "
        "peak step first, the KV cache gets the rest (unless --kv-cache-gib fixes it); refused on the CPU",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: run decode steps eagerly instead of replaying the CUDA graphs captured at start (one per "
        "batch-size bucket up to --max-num-seqs); saves their memory and start-up time",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument(
        "--quantization",
        default="none",
        choices=["none", "int8"],
        help="int8: the decoder's linear layers as int8 weights (one scale per output channel), quantized at "
        "load; adapters, activations and the KV cache keep --dtype. A checkpoint that is int8 already "
        "(compressed-tensors, GGUF Q8_0) is served as int8 either way",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="KV-cache size (default: 1 on the CPU; on CUDA what --gpu-memory-utilization leaves)",
    )
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "cpu_kernel", "triton"],
        help="attention: auto uses Triton (decode) on CUDA, the compiled CPU kernels (decode, bf16 prefill) on the CPU",
    )
    p.add_argument(
        "--layer-backend",
        default="auto",
        choices=["auto", "torch", "cpu_kernel", "triton"],
        help="dense layers: auto uses the compiled CPU kernels (linear, fused norms, BGMV) on the CPU in bf16 and "
        "the Triton layer ops (norm with the residual add, rotary, SiLU-and-multiply) on CUDA",
    )
    p.add_argument(
        "--speculative",
        default="off",
        choices=["off", "ngram", "draft"],
        help="speculative decoding by default (a request's 'speculative' field overrides it): ngram proposes by "
        "prompt lookup, draft: the --draft-model proposes k tokens greedily; either is exact under greedy, the "
        "sampled distribution unchanged; off by itself in compute-bound steps",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        metavar="URI",
        help="a smaller model with the target's tokenizer for --speculative draft (and requests that ask for "
        "it): the same sources as --model, resolved through the same model cache",
    )
    p.add_argument(
        "--draft-cost-ratio",
        type=float,
        default=None,
        help="a draft pass's time over a plain decode step's, for whether a step's draft proposals pay "
        "(default: measured as the server runs; 0: the draft always proposes)",
    )
    p.add_argument("--speculative-k", type=int, default=4, help="most tokens a sequence proposes a step")
    p.add_argument(
        "--speculative-max-step-tokens",
        type=int,
        default=EngineConfig.speculative_max_step_tokens,
        help="proposals only while a step holds fewer tokens than this (past it a step is compute-bound)",
    )


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def _config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=a.model,
        model_cache=a.model_cache,
        offline=a.offline,
        dtype=a.dtype,
        quantization=a.quantization,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        **_device_fields(a),
        attention_backend=a.attention_backend,
        layer_backend=a.layer_backend,
        speculative=a.speculative,
        draft_model=a.draft_model,
        draft_cost_ratio=a.draft_cost_ratio,
        speculative_k=a.speculative_k,
        speculative_max_step_tokens=a.speculative_max_step_tokens,
    )


def _params(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed
    )


def _device_name(value: str) -> str:
    try:
        check_device_name(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _device_fields(a: argparse.Namespace) -> dict:
    """The device options of both EngineConfigs (chat and serve)."""
    return {
        "device": a.device,
        "gpu_memory_utilization": a.gpu_memory_utilization,
        "enforce_eager": a.enforce_eager,
        "kv_cache_bytes": None if a.kv_cache_gib is None else int(a.kv_cache_gib * 2**30),
    }


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _serve_args(p: argparse.ArgumentParser) -> None:
    from loraplane_server.serving.http.server_config import parse_bytes

    p.add_argument("--adapter-dir", help="serve every PEFT adapter in this directory under its directory name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--served-model-name", help="the base model's name in the API (default: --model)")
    p.add_argument("--max-model-len", type=int, help="context length (default: the model's own)")
    p.add_argument("--num-kv-blocks", type=int, help="KV-cache blocks (default: from --kv-cache-gib)")
    p.add_argument(
        "--max-loras",
        type=int,
        default=8,
        help="device adapter slots: distinct adapters per step; at most N-1 adapters can be pinned",
    )
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.add_argument("--host-cache-bytes", type=parse_bytes, default="2GiB", help="adapter cache in host memory")
    p.add_argument("--disk-cache-bytes", type=parse_bytes, default="20GiB", help="adapter cache on local disk")
    p.add_argument("--disk-cache-dir", help="default: <user cache>/loraplane/adapters")
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests beyond this get 429")
    p.add_argument(
        "--admin-token",
        default=os.environ.get("LORAPLANE_ADMIN_TOKEN"),
        help="bearer token for the admin routes and for registering new adapters from any route "
        "(default: $LORAPLANE_ADMIN_TOKEN; none: both open)",
    )
    p.add_argument(
        "--allow-anonymous-adapter-load",
        action="store_true",
        default=_env_flag("LORAPLANE_ALLOW_ANONYMOUS_ADAPTER_LOAD"),
        help="with --admin-token: let clients without the token register new adapters through "
        "/generate's adapter_source or an org/repo adapter_id (default: off, they get 401; "
        "$LORAPLANE_ALLOW_ANONYMOUS_ADAPTER_LOAD=1 turns it on)",
    )
    p.add_argument(
        "--adapter-source-allow",
        action="append",
        default=[],
        metavar="PREFIX",
        help="allowed adapter sources (repeatable): a directory or a URI prefix such as hf:// or "
        "s3://bucket/; default hf://, and --adapter-dir is always allowed",
    )
    p.add_argument("--max-body-bytes", type=parse_bytes, default="4MiB")
    p.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    p.add_argument(
        "--admin-port",
        type=int,
        default=None,
        help="serve the admin routes (/v1/adapters, vLLM's load/unload, /v1/prewarm/complete, /v1/debug/engine) on "
        "this port alone, so that a network policy can limit who reaches them (default: on --port)",
    )
    p.add_argument(
        "--prewarm-timeout",
        type=float,
        default=0.0,
        help="seconds a loaded server stays out of rotation (/ready 503 'prewarming') until POST /v1/prewarm/complete "
        "says its adapters are resident (the operator sets it); 0: ready once the model is loaded",
    )
    p.add_argument(
        "--metrics-top-adapters",
        type=int,
        default=100,
        help="adapters with their own usage label in /metrics; the rest aggregate",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="intra-op threads for the engine (0: one per core, at most the cgroup's CPU limit rounded up; 1 avoids "
        "spin-waits on a busy shared CPU)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _server_config(a: argparse.Namespace):  # noqa: ANN202 - imported lazily: chat needs no HTTP stack
    from loraplane_server.serving.http.server_config import ServerConfig

    engine = EngineConfig(
        model=a.model,
        model_cache=os.path.abspath(a.model_cache) if a.model_cache else None,
        offline=a.offline,
        dtype=a.dtype,
        quantization=a.quantization,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        **_device_fields(a),
        num_kv_blocks=a.num_kv_blocks,
        max_model_len=a.max_model_len,
        max_loras=a.max_loras,
        max_lora_rank=a.max_lora_rank,
        adapter_dir=os.path.abspath(a.adapter_dir) if a.adapter_dir else None,
        host_cache_bytes=a.host_cache_bytes,
        disk_cache_bytes=a.disk_cache_bytes,
        disk_cache_dir=a.disk_cache_dir,
        attention_backend=a.attention_backend,
        layer_backend=a.layer_backend,
        speculative=a.speculative,
        draft_model=a.draft_model,
        draft_cost_ratio=a.draft_cost_ratio,
        speculative_k=a.speculative_k,
        speculative_max_step_tokens=a.speculative_max_step_tokens,
    )
    return ServerConfig(
        engine=engine,
        host=a.host,
        port=a.port,
        admin_port=a.admin_port,
        served_model_name=a.served_model_name,
        max_queue=a.max_queue,
        admin_token=a.admin_token or None,
        allow_anonymous_adapter_load=a.allow_anonymous_adapter_load,
        adapter_source_allow=tuple(a.adapter_source_allow),
        max_body_bytes=a.max_body_bytes,
        shutdown_grace_s=a.shutdown_grace,
        prewarm_timeout_s=a.prewarm_timeout,
        metrics_top_adapters=a.metrics_top_adapters,
        torch_threads=a.torch_threads,
        log_level=a.log_level,
    )


def cmd_serve(a: argparse.Namespace) -> int:
    """Serve the HTTP API (LoRAX, OpenAI, vLLM admin, /metrics) until SIGTERM."""
    from loraplane_server.serving.http.app import serve

    try:
        config = _server_config(a)
    except ValueError as exc:
        print(f"loraplane serve: {exc}", file=sys.stderr)
        return 2
    return serve(config)


def cmd_chat(a: argparse.Namespace) -> int:
    """Chat with the model: one answer for --prompt, else a prompt loop on stdin."""
    from loraplane_server.engine.llm_engine import LLMEngine
    from loraplane_server.platforms.device import DeviceError
    from loraplane_server.spec.draft import DraftModelError
    from loraplane_server.store.sources import ModelSourceError

    try:
        config = _config(a)
    except ValueError as exc:
        print(f"loraplane chat: {exc}", file=sys.stderr)
        return 2
    try:
        engine = LLMEngine(config)
    except (ModelSourceError, DraftModelError, DeviceError) as exc:  # says what to fix: no traceback
        print(f"{FAILURE_PREFIX}{exc}", file=sys.stderr)
        return 1
    history: list[dict[str, str]] = []
    prompts = [a.prompt] if a.prompt else None
    print(f"loraplane: {a.model} ({engine.dtype}), {engine.inputs.blocks.num_blocks} KV blocks", file=sys.stderr)
    while True:
        if prompts is not None:
            if not prompts:
                return 0
            user = prompts.pop()
        else:
            try:
                user = input("you> ")
            except EOFError:
                return 0
        history.append({"role": "user", "content": user})
        text = engine.tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
        start = time.monotonic()
        out = engine.generate([text], _params(a))[0]
        history.append({"role": "assistant", "content": out.text})
        print(out.text)
        rate = len(out.token_ids) / (time.monotonic() - start)
        print(f"[{len(out.token_ids)} tokens, {rate:.1f} tokens/s, {out.finish_reason}]", file=sys.stderr)


def cmd_pull(a: argparse.Namespace) -> int:
    """Resolve --model into the model cache as serve does, load nothing, print the directory: a vLLM pod's init
    container, which leaves the model on the shared volume and (--link) a stable path `vllm serve` loads.
    A failure ends stderr with serve's FAILURE_PREFIX line, so the pod's termination message carries it."""
    import traceback

    from loraplane_server.store.models import default_cache_dir, resolve_model
    from loraplane_server.store.sources import ModelSourceError, scrub_secrets

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cache = os.path.abspath(os.path.expanduser(a.model_cache)) if a.model_cache else None
    try:
        model_dir = resolve_model(EngineConfig(model=a.model, model_cache=cache, offline=a.offline))
        if a.link:
            target = _link(Path(a.link), model_dir, Path(cache) if cache else default_cache_dir())
            print(f"loraplane pull: {a.link} -> {target}", file=sys.stderr)
    except ModelSourceError as exc:  # says what to fix: no traceback
        reason = str(exc)
    except OSError as exc:  # the link: a directory in the way, no permission
        reason = f"--link {a.link}: {exc.strerror or exc}"
    except Exception as exc:  # noqa: BLE001 - any failure ends the pull with its reason as the last line
        logging.getLogger("loraplane.model").error("the pull failed\n%s", scrub_secrets(traceback.format_exc()))
        reason = f"{type(exc).__name__}: {exc}"
    else:
        print(model_dir, flush=True)
        return 0
    logging.shutdown()  # flush the log first: the reason is the last line on stderr
    print(f"{FAILURE_PREFIX}{scrub_secrets(' '.join(reason.split()))}", file=sys.stderr, flush=True)
    return 1


def _link(link: Path, model_dir: Path, root: Path) -> str:
    """Point link at model_dir in one rename (a symlink made under a temporary name, then os.replace), so a
    reader sees the old target or the new one, never none. The target is relative when both lie under root (the
    model cache), so the link holds wherever the volume is mounted. Returns the target written."""
    link = Path(os.path.abspath(link))
    link.parent.mkdir(parents=True, exist_ok=True)
    real_root, real_dir, real_parent = (Path(os.path.realpath(p)) for p in (root, model_dir, link.parent))
    inside = real_parent.is_relative_to(real_root)
    if inside and real_dir.is_relative_to(real_root):
        target = os.path.relpath(real_dir, real_parent)
    else:
        target = os.path.abspath(model_dir)
        if inside:
            print(
                f"loraplane pull: warning: {target} lies outside the model cache {root} (for hf://, HF_HUB_CACHE "
                "or HF_HOME chose it): a container that mounts only the cache will not find it",
                file=sys.stderr,
            )
    tmp = link.with_name(f".{link.name}.{uuid.uuid4().hex[:8]}.tmp")
    os.symlink(target, tmp, target_is_directory=True)
    try:
        os.replace(tmp, link)
    except OSError:
        tmp.unlink()
        raise
    return target


def cmd_operator(a: argparse.Namespace) -> int:
    """Reconcile BaseModelServer and LoRAAdapter resources until SIGTERM."""
    from loraplane_operator.main import run_operator
    from loraplane_operator.network_builders import Peer, parse_labels

    try:
        labels = parse_labels(a.pod_labels)
    except ValueError as exc:
        print(f"loraplane operator: --pod-labels: {exc}", file=sys.stderr)
        return 2
    peer = Peer(a.pod_namespace, labels) if a.pod_namespace and labels else None
    run_operator(
        namespace=a.namespace,
        standalone=True,
        liveness_endpoint=a.liveness,
        verbose=a.verbose,
        metrics_port=a.metrics_port,
        metrics_address=a.metrics_address,
        leader_election=a.leader_elect,
        peer=peer,
    )
    return 0


def _router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--pod",
        action="append",
        default=[],
        metavar="[NAME=]URL",
        help="a server pod (repeat); NAME is what the ranking hashes (default host:port)",
    )
    p.add_argument("--namespace", help="with --selector: find the server pods through the Kubernetes API")
    p.add_argument("--selector", help="label selector of the server pods, e.g. loraplane.dev/server=smollm2")
    p.add_argument("--pod-port", type=int, default=8080, help="the server pods' HTTP port (with --selector)")
    p.add_argument(
        "--pod-admin-port",
        type=int,
        default=None,
        help="the server pods' --admin-port, where residency (/v1/adapters) is read: for --pod URLs, and for pods "
        "from --selector that name no 'admin' container port (default: --pod-port)",
    )
    p.add_argument(
        "--epsilon", type=float, default=0.5, help="load bound: a pod over (1 + epsilon) x the mean is skipped"
    )
    p.add_argument(
        "--min-bound", type=int, default=2, help="a pod with fewer requests than this is never over the load bound"
    )
    p.add_argument(
        "--spill-queue", type=int, default=8, help="widen a hot adapter to its next pod at this many requests a pod"
    )
    p.add_argument("--poll-seconds", type=float, default=1.0, help="how often residency and load are read")
    p.add_argument(
        "--engine",
        choices=["loraplane", "vllm"],
        default="loraplane",
        help="the pods' engine: loraplane servers, or vllm serve pods (residency from /v1/models; an adapter "
        "goes only to the pods holding it; $LORAPLANE_ADMIN_TOKEN is then vLLM's --api-key)",
    )
    p.add_argument(
        "--hold-timeout",
        type=float,
        default=120.0,
        help="seconds a request waits for a Ready pod when there is none (a pool scaled to zero wakes on the held "
        "count); then 503 with Retry-After. 0: refuse at once",
    )
    p.add_argument("--hold-max", type=int, default=256, help="requests held at once; the next gets a 503 at once")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def cmd_router(a: argparse.Namespace) -> int:
    """Route requests across a server pool by adapter (serving/router/app.py). The servers' admin token, which
    residency needs, comes from $LORAPLANE_ADMIN_TOKEN (never a flag: it would show in the process list)."""
    import uvicorn

    from loraplane_server.serving.router.app import RouterConfig, create_router_app

    try:
        config = RouterConfig(
            pods=tuple(a.pod),
            namespace=a.namespace,
            selector=a.selector,
            pod_port=a.pod_port,
            pod_admin_port=a.pod_admin_port,
            admin_token=os.environ.get("LORAPLANE_ADMIN_TOKEN") or None,
            epsilon=a.epsilon,
            min_bound=a.min_bound,
            spill_queue=a.spill_queue,
            poll_s=a.poll_seconds,
            engine=a.engine,
            hold_max=a.hold_max,
            hold_timeout_s=a.hold_timeout,
        )
    except ValueError as exc:
        print(f"loraplane router: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(create_router_app(config), host=a.host, port=a.port, log_level=a.log_level)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loraplane", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    chat = sub.add_parser("chat", help="chat with the model in the terminal")
    _engine_args(chat)
    _sampling_args(chat)
    chat.add_argument("--prompt", help="answer this one message and exit")
    chat.set_defaults(func=cmd_chat)
    serve = sub.add_parser("serve", help="serve the HTTP API")
    _engine_args(serve)
    _serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    pull = sub.add_parser("pull", help="fetch --model into the model cache as serve would, print its directory")
    _model_args(pull)
    pull.add_argument(
        "--link",
        metavar="PATH",
        help="also point PATH at the model's directory (a symlink swapped in atomically, relative inside the "
        "model cache), e.g. <cache>/served/<server name> for a vLLM server pod to load",
    )
    pull.set_defaults(func=cmd_pull)
    router = sub.add_parser("router", help="route requests across a server pool by adapter")
    _router_args(router)
    router.set_defaults(func=cmd_router)
    op = sub.add_parser("operator", help="run the Kubernetes operator (kopf)")
    op.add_argument("--namespace", default=None, help="watch one namespace (default: the whole cluster)")
    op.add_argument("--liveness", default=None, help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    op.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    op.add_argument("--metrics-address", default="0.0.0.0", help="the address /metrics binds (with --metrics-port)")
    op.add_argument(
        "--leader-elect",
        default=None,
        metavar="NAMESPACE/NAME",
        help="campaign for this coordination.k8s.io Lease and reconcile only while holding it (several replicas)",
    )
    op.add_argument(
        "--pod-namespace",
        default=os.environ.get("POD_NAMESPACE"),
        help="the namespace of the operator's own pods (default $POD_NAMESPACE); with --pod-labels, the servers' "
        "NetworkPolicy lets those pods reach the admin port",
    )
    op.add_argument("--pod-labels", default="", help="the labels of the operator's own pods: k=v,k2=v2")
    op.add_argument("--verbose", action="store_true")
    op.set_defaults(func=cmd_operator)
    a = parser.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
