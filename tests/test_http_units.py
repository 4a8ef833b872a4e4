"""The HTTP layer's plain parts, without a server: bounded usage labels,
admission and draining, start-up progress, error shapes, id validation, per-app metrics, and the serve command line."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplane_server.config import EngineConfig
from loraplane_server.engine.llm_engine import LLMEngine
from loraplane_server.serving import cli
from loraplane_server.serving.bounded_labels import OTHER
from loraplane_server.serving.http.admin import is_valid_adapter_id
from loraplane_server.serving.http.errors import Rejected, error_body
from loraplane_server.serving.http.metrics import AdapterUsage, Metrics
from loraplane_server.serving.http.server_config import ServerConfig, parse_bytes
from loraplane_server.serving.http.state import Lifecycle, Phase


def test_usage_labels_stay_bounded_and_every_series_only_grows() -> None:
    usage = AdapterUsage(max_labels=3)
    seen: dict[str, tuple[int, int]] = {}
    for i in range(300):
        adapter = f"a{i % 10}" if i % 3 else "hot"
        usage.record(adapter, prompt_tokens=5, generated_tokens=(i % 7) + 1)
        series = dict(usage.series())
        assert len(series) <= 4  # three adapters and OTHER
        for label, u in series.items():
            old = seen.get(label, (0, 0))
            assert u.prompt_tokens >= old[0] and u.generated_tokens >= old[1], (label, old, u)
            seen[label] = (u.prompt_tokens, u.generated_tokens)
    final = dict(usage.series())
    assert "hot" in final and OTHER in final  # the busiest adapter has its own label
    assert usage.retired  # labels did change hands


def test_admission_queue_limit_and_draining() -> None:
    life = Lifecycle(max_queue=2)
    with pytest.raises(Rejected) as exc:
        life.admit()
    assert exc.value.status == 503  # still loading
    life.mark_ready()
    life.admit()
    life.admit()
    with pytest.raises(Rejected) as exc:
        life.admit()
    assert exc.value.status == 429 and exc.value.reason == "queue_full"
    life.started()  # one got its first token: room for one more
    life.admit()
    life.begin_drain(grace_s=60)
    assert not life.is_ready and not life.can_exit  # three in flight
    with pytest.raises(Rejected) as exc:
        life.admit()
    assert exc.value.status == 503 and exc.value.reason == "draining"
    for _ in range(3):
        life.finished()
    assert life.can_exit
    late = Lifecycle(max_queue=1)
    late.mark_ready()
    late.admit()
    late.begin_drain(grace_s=0.01)
    time.sleep(0.02)
    assert late.can_exit  # out of time


def test_the_prewarm_gate_holds_a_loaded_server_out_of_rotation_until_opened() -> None:
    life = Lifecycle(max_queue=4, prewarm_timeout_s=30)
    life.mark_ready()  # loaded: behind the gate
    assert life.phase == Phase.PREWARMING and not life.is_ready
    body = life.progress()
    assert body["status"] == "prewarming" and body["prewarm_timeout_seconds"] == 30 and "prewarm" not in body
    life.admit()  # the model is loaded: a request sent to the pod itself is served
    assert life.open_gate("operator") and life.is_ready
    assert life.progress() == {"status": "ready", "prewarm": "operator"}
    assert not life.open_gate("timeout")  # once: the first word stands
    ungated = Lifecycle(max_queue=1)
    ungated.mark_ready()
    assert ungated.is_ready and not ungated.open_gate("operator") and "prewarm" not in ungated.progress()
    draining = Lifecycle(max_queue=1, prewarm_timeout_s=30)
    draining.mark_ready()
    draining.begin_drain(grace_s=1)  # SIGTERM behind the gate: it drains, and the gate stays shut
    assert not draining.open_gate("operator") and not draining.is_ready and draining.can_exit


def test_ready_reports_the_start_up_step_the_engine_is_in(tiny_llama_dir: Path) -> None:
    """/ready's body while loading: the step LLMEngine last reported and how long it has run, so a
    probe or a test waits on progress instead of a fixed time; the error once failed."""
    life = Lifecycle(max_queue=1)
    assert life.progress()["step"] == "starting"
    steps: list[str] = []

    def on_phase(step: str) -> None:
        steps.append(step)
        life.set_step(step)

    LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=8), on_phase=on_phase)
    assert steps[0] == "resolving the model" and steps[-1] == "loading the tokenizer"
    assert steps.index("loading the weights") > steps.index("building the CPU kernels")
    body = life.progress()
    assert body["status"] == "loading" and body["step"] == "loading the tokenizer"
    assert 0 <= float(body["step_seconds"]) <= float(body["loading_seconds"])  # type: ignore[arg-type]
    life.mark_ready()
    assert life.progress() == {"status": "ready"}
    life.mark_failed("OSError: no weights")
    assert life.progress() == {"status": "failed", "error": "OSError: no weights"}


def test_error_bodies_follow_each_api() -> None:
    assert error_body("/generate", 422, "bad") == {"error": "bad", "error_type": "validation"}
    assert error_body("/generate_stream", 429, "busy")["error_type"] == "overloaded"
    body = error_body("/v1/completions", 404, "no such model", code="adapter_not_found")
    assert body == {
        "error": {"message": "no such model", "type": "not_found_error", "param": None, "code": "adapter_not_found"}
    }


@pytest.mark.parametrize("adapter_id", ["french", "a-1", "v1.2_x", "A" * 128])
def test_plain_adapter_ids_are_valid(adapter_id: str) -> None:
    assert is_valid_adapter_id(adapter_id)


@pytest.mark.parametrize(
    "adapter_id", ["", "..", "../x", "a/b", "/abs", "a..b", ".hidden", "-x", "a\\b", "é", "A" * 129, "x\n", "a b"]
)
def test_path_like_adapter_ids_are_refused(adapter_id: str) -> None:
    assert not is_valid_adapter_id(adapter_id)


def test_each_app_has_its_own_metrics_registry() -> None:
    one, two = Metrics("base", 10), Metrics("base", 10)
    one.record_request("lorax", "french", "length", 7, 3, 0.1, 0.5)

    def samples(m: Metrics) -> dict:
        text = m.render().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }

    a, b = samples(one), samples(two)
    assert a[("loraplane_prompt_tokens_total", ())] == 7 and b[("loraplane_prompt_tokens_total", ())] == 0
    assert a[("loraplane_adapter_generation_tokens_total", (("adapter", "french"),))] == 3
    assert ("loraplane_adapter_generation_tokens_total", (("adapter", "french"),)) not in b
    assert b[("vllm:num_requests_waiting", ())] == 0


def test_sizes_and_config_validation() -> None:
    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes("512MiB") == 512 << 20 and parse_bytes("1000") == 1000
    with pytest.raises(ValueError):
        parse_bytes("lots")
    with pytest.raises(ValueError, match="max_queue"):
        ServerConfig(max_queue=0)
    with pytest.raises(ValueError, match="admin token"):
        ServerConfig(admin_token="short")


def test_serve_builds_one_config_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import loraplane_server.serving.http.app as http_app

    got: list[ServerConfig] = []
    monkeypatch.setattr(http_app, "serve", lambda config: got.append(config) or 0)
    monkeypatch.setenv("LORAPLANE_ADMIN_TOKEN", "from-the-environment")
    argv = [
        "serve",
        "--adapter-dir",
        str(tmp_path),
        "--port",
        "9000",
        "--max-queue",
        "7",
        "--max-loras",
        "3",
        "--adapter-source-allow",
        "s3://bucket/",
        "--adapter-source-allow",
        "hf://org/",
        "--host-cache-bytes",
        "1GiB",
        "--dtype",
        "float32",
    ]
    assert cli.main(argv) == 0
    (config,) = got
    assert config.port == 9000 and config.max_queue == 7 and config.engine.max_loras == 3
    assert config.engine.host_cache_bytes == 1 << 30 and config.engine.dtype == "float32"
    assert config.admin_token == "from-the-environment" and config.model_name == "smollm2-135m"
    assert config.allowlist == [str(tmp_path), "s3://bucket/", "hf://org/"]
    assert ServerConfig().allowlist == ["hf://"]


def test_draft_model_flags_reach_both_engine_configs(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import loraplane_server.serving.http.app as http_app

    got: list[ServerConfig] = []
    monkeypatch.setattr(http_app, "serve", lambda config: got.append(config) or 0)
    draft = ["--speculative", "draft", "--draft-model", "hf://HuggingFaceTB/SmolLM2-135M", "--model-cache", "/c"]
    assert cli.main(["serve", *draft]) == 0
    (config,) = got
    assert config.engine.speculative == "draft" and config.engine.draft_model == "hf://HuggingFaceTB/SmolLM2-135M"
    assert config.engine.model_cache == "/c"  # the draft resolves through the target's cache
    chat = argparse.ArgumentParser()
    cli._engine_args(chat)
    engine = cli._config(chat.parse_args(draft))
    assert engine.speculative == "draft" and engine.draft_model == "hf://HuggingFaceTB/SmolLM2-135M"
    assert cli._config(chat.parse_args([])).draft_model is None
    assert cli.main(["serve", "--speculative", "draft"]) == 2  # no --draft-model: refused before loading
    assert "--draft-model" in capsys.readouterr().err
    assert cli.main(["chat", "--speculative", "draft", "--prompt", "hi"]) == 2  # the same, no traceback
    assert "--draft-model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        chat.parse_args(["--speculative", "medusa"])
