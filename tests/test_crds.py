"""The CRDs in crds/: structural schemas, valid defaults, samples that validate, printer columns and scale
paths that exist, and CEL rules that accept the samples and reject what they should (cel-python): model
sources, the model cache and credentials get one clear message per mistake (the same messages a real
kube-apiserver gives)."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CRDS = {
    "BaseModelServer": ROOT / "crds" / "loraplane.dev_basemodelservers.yaml",
    "LoRAAdapter": ROOT / "crds" / "loraplane.dev_loraadapters.yaml",
}
SAMPLES = sorted((ROOT / "crds" / "samples").glob("*.yaml"))


def load(kind: str) -> dict:
    return yaml.safe_load(CRDS[kind].read_text())


def schema_of(kind: str) -> dict:
    (version,) = load(kind)["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def strip_extensions(node):
    """The schema as plain JSON Schema: no x-kubernetes-* keys (int-or-string keeps its anyOf)."""
    if isinstance(node, dict):
        return {k: strip_extensions(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if isinstance(node, list):
        return [strip_extensions(v) for v in node]
    return node


# a CRD schema is OpenAPI v3.0, whose exclusiveMinimum/exclusiveMaximum are booleans beside minimum/maximum, as in
# JSON Schema draft 4 (later drafts take a number there, and would read `true` as 1)
OpenAPIValidator = jsonschema.Draft4Validator


def validate(kind: str, obj: dict) -> None:
    jsonschema.validate(obj, strip_extensions(schema_of(kind)), cls=OpenAPIValidator)


def walk(node: dict, path: str = ""):
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


def apply_defaults(node: dict, value):
    """Kubernetes-style defaulting: absent properties with a default are filled, recursively."""
    if isinstance(value, dict) and node.get("properties"):
        for name, child in node["properties"].items():
            if name not in value and "default" in child:
                value[name] = copy.deepcopy(child["default"])
            if name in value:
                value[name] = apply_defaults(child, value[name])
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        return [apply_defaults(node["items"], v) for v in value]
    return value


def samples_of(kind: str) -> list[dict]:
    docs = [yaml.safe_load(p.read_text()) for p in SAMPLES]
    return [d for d in docs if d["kind"] == kind]


@pytest.mark.parametrize("kind", CRDS)
def test_crd_metadata(kind):
    crd = load(kind)
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    spec = crd["spec"]
    assert spec["group"] == "loraplane.dev"
    assert crd["metadata"]["name"] == f"{spec['names']['plural']}.loraplane.dev"
    assert spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == kind
    assert spec["names"]["categories"] == ["loraplane"]
    assert spec["names"]["shortNames"] == {"BaseModelServer": ["bms"], "LoRAAdapter": ["lora"]}[kind]
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"]["status"] == {}


@pytest.mark.parametrize("kind", CRDS)
def test_schema_is_structural(kind):
    root = schema_of(kind)
    for path, node in walk(root):
        int_or_string = node.get("x-kubernetes-int-or-string")
        if int_or_string:
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
            assert "type" not in node, path
        else:
            assert "type" in node, f"{kind}{path} has no type"
            assert "anyOf" not in node and "oneOf" not in node, path
        if "properties" in node or "additionalProperties" in node:
            assert node["type"] == "object", path
            assert not ("properties" in node and "additionalProperties" in node), path
        if "items" in node:
            assert node["type"] == "array", path
        if node.get("x-kubernetes-list-type") == "map":
            keys = node["x-kubernetes-list-map-keys"]
            assert set(keys) <= set(node["items"].get("required", [])), path
        assert "description" in node or path.count(".") > 1 or path in ("", ".apiVersion", ".kind", ".metadata")
    # the API server allows only name restrictions under metadata (not even a description)
    assert set(root["properties"]["metadata"]) <= {"type", "properties"}
    assert set(root["properties"]["metadata"].get("properties") or {}) <= {"name"}


def properties(node: dict, path: str = ""):
    """Every named property (what kubectl explain lists), with its path."""
    for name, child in (node.get("properties") or {}).items():
        yield f"{path}.{name}", child
        yield from properties(child, f"{path}.{name}")
    for key, mark in (("items", "[]"), ("additionalProperties", "{}")):
        if isinstance(node.get(key), dict):
            yield from properties(node[key], path + mark)


@pytest.mark.parametrize("kind", CRDS)
def test_every_property_has_a_description(kind):
    """Issue 21: kubectl explain had nothing for nine BaseModelServer fields (env, tolerations, min/max replicas)."""
    documented = [(p, node) for p, node in properties(schema_of(kind)) if not p.startswith(".metadata")]
    missing = [path for path, node in documented if not str(node.get("description", "")).strip()]
    assert missing == [], f"{kind}: no description for {missing}"
    assert len(list(properties(schema_of(kind)))) > 30


@pytest.mark.parametrize("kind", CRDS)
def test_spec_fields_are_documented(kind):
    spec = schema_of(kind)["properties"]["spec"]
    for name, child in spec["properties"].items():
        assert child.get("description"), f"{kind}.spec.{name} has no description"


@pytest.mark.parametrize("kind", CRDS)
def test_defaults_are_valid_under_their_schemas(kind):
    num = 0
    for _path, node in walk(schema_of(kind)):
        if "default" in node:
            plain = strip_extensions({k: v for k, v in node.items() if k != "default"})
            jsonschema.validate(node["default"], plain, cls=OpenAPIValidator)
            num += 1
    assert num >= 3


def test_samples_cover_both_kinds():
    kinds = sorted(yaml.safe_load(p.read_text())["kind"] for p in SAMPLES)
    assert kinds == ["BaseModelServer", "BaseModelServer", "LoRAAdapter", "LoRAAdapter", "LoRAAdapter"]
    names = {d["metadata"]["name"] for d in samples_of("LoRAAdapter")}
    assert names == {"french", "pirate", "json"}
    for d in samples_of("LoRAAdapter"):
        assert d["spec"]["source"] == f"/opt/loraplane/adapters/{d['metadata']['name']}"


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_sample_validates_before_and_after_defaulting(path):
    obj = yaml.safe_load(path.read_text())
    assert obj["apiVersion"] == "loraplane.dev/v1alpha1"
    validate(obj["kind"], obj)
    validate(obj["kind"], apply_defaults(schema_of(obj["kind"]), copy.deepcopy(obj)))


def test_defaulting_fills_what_the_operator_relies_on():
    bms = apply_defaults(schema_of("BaseModelServer"), {"spec": {}})
    assert bms["spec"]["model"] == "smollm2-135m"
    assert bms["spec"]["replicas"] == 1 and bms["spec"]["port"] == 8080
    assert bms["spec"]["resources"]["gpus"] == 1
    auto = apply_defaults(schema_of("BaseModelServer"), {"spec": {"autoscaling": {"enabled": True}}})
    assert auto["spec"]["autoscaling"] == {
        "enabled": True,
        "kind": "hpa",
        "minReplicas": 1,
        "maxReplicas": 4,
        "targetQueueDepth": 8,
        "scaleDownStabilizationSeconds": 300,
        "prometheusAddress": "http://prometheus-operated.monitoring.svc:9090",
        "pollingIntervalSeconds": 30,
    }
    router = apply_defaults(schema_of("BaseModelServer"), {"spec": {"router": {"enabled": True}}})["spec"]["router"]
    assert (router["holdTimeoutSeconds"], router["holdMaxRequests"]) == (120, 256)
    lora = apply_defaults(schema_of("LoRAAdapter"), {"spec": {"baseModelServer": "s", "source": "/a"}})
    assert lora["spec"]["prewarm"] == {"tier": "host"} and lora["spec"]["pinned"] is False


@pytest.mark.parametrize(
    ("kind", "patch"),
    [
        ("LoRAAdapter", {"prewarm": {"tier": "host", "replicas": 0}}),
        ("LoRAAdapter", {"adapterId": "-bad"}),
        ("LoRAAdapter", {"baseModelServer": "Not_A_Name"}),
        ("BaseModelServer", {"replicas": -1}),
        ("BaseModelServer", {"port": 70000}),
        ("BaseModelServer", {"engine": {"dtype": "int8"}}),
        ("BaseModelServer", {"engine": {"quantization": "int4"}}),
        ("BaseModelServer", {"engine": {"speculative": "medusa"}}),
        ("BaseModelServer", {"engine": {"draftModel": ""}}),
        ("BaseModelServer", {"engine": {"draftModel": "/m" * 600}}),
        ("BaseModelServer", {"engine": {"hostCacheBytes": "lots"}}),
        ("BaseModelServer", {"engine": {"gpuMemoryUtilization": 0}}),
        ("BaseModelServer", {"engine": {"gpuMemoryUtilization": -0.5}}),
        ("BaseModelServer", {"engine": {"gpuMemoryUtilization": 1.01}}),
        ("BaseModelServer", {"engine": {"gpuMemoryUtilization": "90%"}}),
        ("BaseModelServer", {"engine": {"enforceEager": "yes"}}),
        ("BaseModelServer", {"resources": {"gpus": -1}}),
        ("BaseModelServer", {"resources": {"requests": {"memory": "16 gigs"}}}),
        ("BaseModelServer", {"autoscaling": {"kind": "vpa"}}),
    ],
)
def test_schema_rejects(kind, patch):
    obj = copy.deepcopy(samples_of(kind)[0])
    obj["spec"].update(patch)
    with pytest.raises(jsonschema.ValidationError):
        validate(kind, obj)


def schema_at(root: dict, json_path: str) -> dict | None:
    node = root
    for part in json_path.lstrip(".").split("."):
        node = (node.get("properties") or {}).get(part)
        if node is None:
            return None
    return node


@pytest.mark.parametrize("kind", CRDS)
def test_printer_columns_point_into_the_schema(kind):
    (version,) = load(kind)["spec"]["versions"]
    columns = version["additionalPrinterColumns"]
    for col in columns:
        if col["jsonPath"] == ".metadata.creationTimestamp":
            assert col["type"] == "date"
            continue
        node = schema_at(schema_of(kind), col["jsonPath"])
        assert node is not None, col
        if col["type"] in ("integer", "string"):
            assert node["type"] == col["type"], col
    names = [c["name"] for c in columns if c.get("priority", 0) == 0]
    expected = {
        "BaseModelServer": ["Model", "Model-Status", "Replicas", "Ready", "Phase", "Age"],
        "LoRAAdapter": ["Server", "Phase", "Ready", "Tier", "Age"],
    }
    assert names == expected[kind]


def test_model_columns():
    """kubectl get bms: MODEL and MODEL-STATUS; -o wide adds DOWNLOADED (kubectl upper-cases the names)."""
    (version,) = load("BaseModelServer")["spec"]["versions"]
    paths = {col["name"]: (col["jsonPath"], col.get("priority", 0)) for col in version["additionalPrinterColumns"]}
    assert paths["Model"] == (".spec.model", 0)
    assert paths["Model-Status"] == (".status.model.phase", 0)
    assert paths["Downloaded"] == (".status.model.progress", 1)
    assert paths["Draft-Status"] == (".status.draftModel.phase", 1)


def test_wide_columns_show_what_is_in_force_and_where():
    """-o wide: AUTOSCALING from the status (off when disabled, not the defaulted kind); PODS: pod:tier."""
    (bms_version,) = load("BaseModelServer")["spec"]["versions"]
    bms_cols = {col["name"]: col for col in bms_version["additionalPrinterColumns"]}
    assert (bms_cols["Autoscaling"]["jsonPath"], bms_cols["Autoscaling"]["priority"]) == (".status.autoscaling", 1)
    assert schema_at(schema_of("BaseModelServer"), ".status.autoscaling")["enum"] == ["off", "hpa", "keda"]
    (lora_version,) = load("LoRAAdapter")["spec"]["versions"]
    lora_cols = {col["name"]: col for col in lora_version["additionalPrinterColumns"]}
    assert (lora_cols["Pods"]["jsonPath"], lora_cols["Pods"]["priority"]) == (".status.pods", 1)
    assert "pod:tier" in lora_cols["Pods"]["description"]


def test_retry_fields_in_the_adapter_status():
    status = schema_of("LoRAAdapter")["properties"]["status"]["properties"]
    retry = status["observedRetry"]
    assert retry["type"] == "string" and "loraplane.dev/retry" in retry["description"]
    assert (status["attempts"]["minimum"], status["attempts"]["maximum"]) == (0, 5)


def test_scale_subresource_paths_exist():
    (version,) = load("BaseModelServer")["spec"]["versions"]
    scale = version["subresources"]["scale"]
    assert scale == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    for path in scale.values():
        assert schema_at(schema_of("BaseModelServer"), path) is not None
    assert schema_at(schema_of("BaseModelServer"), ".status.selector")["type"] == "string"


# CEL
celpy = pytest.importorskip("celpy")


def rules(kind: str) -> list[tuple[str, str, str]]:
    """(path, rule, message) for every x-kubernetes-validations rule."""
    out = []
    for path, node in walk(schema_of(kind)):
        for r in node.get("x-kubernetes-validations") or []:
            out.append((path, r["rule"], r["message"]))
    return out


def at(obj, path: str):
    for part in [p for p in path.split(".") if p]:
        if obj is None or part not in obj:
            return None
        obj = obj[part]
    return obj


@functools.cache
def program(rule: str):
    env = celpy.Environment()
    return env.program(env.compile(rule))


def violations(kind: str, obj: dict, old: dict | None = None) -> list[str]:
    """Messages of the rules the (defaulted) object breaks, as the API server would evaluate them."""
    obj = apply_defaults(schema_of(kind), copy.deepcopy(obj))
    broken = []
    for path, rule, message in rules(kind):
        if "oldSelf" in rule and old is None:
            continue
        value = at(obj, path)
        if value is None:
            continue
        activation = {"self": celpy.json_to_cel(value)}
        if "oldSelf" in rule:
            old_value = at(apply_defaults(schema_of(kind), copy.deepcopy(old)), path)
            if old_value is None:
                continue
            activation["oldSelf"] = celpy.json_to_cel(old_value)
        if not bool(program(rule).evaluate(activation)):
            broken.append(message)
    return broken


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_samples_pass_cel_rules(path):
    obj = yaml.safe_load(path.read_text())
    assert violations(obj["kind"], obj) == []
    assert violations(obj["kind"], obj, old=obj) == []


def lora(**spec) -> dict:
    base = {"baseModelServer": "smollm2", "source": "/opt/loraplane/adapters/french"}
    return {"metadata": {"name": "french"}, "spec": {**base, **spec}}


@pytest.mark.parametrize(
    "source", ["/abs/path", "file:///abs", "hf://org/repo@main", "s3://bucket/prefix", "https://h/a.tgz"]
)
def test_cel_accepts_supported_sources(source):
    assert violations("LoRAAdapter", lora(source=source)) == []


@pytest.mark.parametrize("source", ["relative/path", "ftp://host/a", "gs://bucket/a", "file://host/a"])
def test_cel_rejects_unsupported_sources(source):
    assert any("source must be" in m for m in violations("LoRAAdapter", lora(source=source)))


def test_cel_prewarm_replicas_needs_a_tier():
    assert violations("LoRAAdapter", lora(prewarm={"tier": "device", "replicas": 2})) == []
    (message,) = violations("LoRAAdapter", lora(prewarm={"tier": "none", "replicas": 2}))
    assert "prewarm.replicas" in message


def test_names_fit_an_adapter_id():
    """The adapter id defaults to the name (at most 128 characters); metadata.name is bounded in the schema,
    the only metadata restriction the API server allows (a root-level CEL rule would add a second line to
    every rejection)."""
    long = lora(source="/a")
    long["metadata"]["name"] = "a" * 129
    with pytest.raises(jsonschema.ValidationError):
        validate("LoRAAdapter", long)
    long["metadata"]["name"] = "a" * 128
    validate("LoRAAdapter", long)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"prewarm": {"tier": "gpu"}}, "prewarm.tier must be one of device, host, disk or none"),
        ({"baseModelServer": None}, "spec.baseModelServer is required: the name of the BaseModelServer"),
        ({"source": None}, "spec.source is required: where the server reads the adapter"),
    ],
)
def test_adapter_mistakes_get_one_clear_line(spec, expected):
    """Issue 21: a required or enum error stops the API server's CEL rules and adds a second line ("some
    validation rules were not checked"), so the LoRAAdapter says these with CEL rules, one line each."""
    obj = lora(**spec)
    obj["spec"] = {k: v for k, v in obj["spec"].items() if v is not None}
    (message,) = violations("LoRAAdapter", obj)
    assert expected in message
    spec = schema_of("LoRAAdapter")["properties"]["spec"]
    blocking = [p for p, node in walk(spec) if node.get("required") or node.get("enum")]
    assert blocking == [], "a required or enum in the LoRAAdapter spec brings the second line back"


def test_cel_immutable_server_and_adapter_id():
    old = lora(adapterId="fr")
    assert violations("LoRAAdapter", lora(adapterId="fr", source="/other"), old=old) == []
    assert any("baseModelServer is immutable" in m for m in violations("LoRAAdapter", lora(
        adapterId="fr", baseModelServer="other"), old=old))  # fmt: skip
    assert any("adapterId is immutable" in m for m in violations("LoRAAdapter", lora(adapterId="en"), old=old))
    assert any("adapterId is immutable" in m for m in violations("LoRAAdapter", lora(), old=old))


def bms(name: str = "smollm2", **spec) -> dict:
    return {"metadata": {"name": name}, "spec": spec}


def test_cel_autoscaling_bounds():
    ok = {"enabled": True, "minReplicas": 2, "maxReplicas": 3}
    assert violations("BaseModelServer", bms(autoscaling=ok)) == []
    bad = {"enabled": True, "minReplicas": 5, "maxReplicas": 3}
    assert any("must not exceed" in m for m in violations("BaseModelServer", bms(autoscaling=bad)))
    defaulted_max = {"enabled": True, "minReplicas": 6}  # maxReplicas defaults to 4
    (message,) = violations("BaseModelServer", bms(autoscaling=defaulted_max))
    assert "(which defaults to 4)" in message
    # disabled: the bounds are not used, so the defaulted maxReplicas must not reject the object (issue 21)
    assert violations("BaseModelServer", bms(autoscaling={"enabled": False, "minReplicas": 6})) == []
    assert violations("BaseModelServer", bms(autoscaling={"minReplicas": 0})) == []
    zero = {"enabled": True, "minReplicas": 0}
    assert any("needs kind: keda" in m for m in violations("BaseModelServer", bms(autoscaling=zero)))
    # scale to zero: nothing but the router's held requests can wake a pool with no pod
    (message,) = violations("BaseModelServer", bms(autoscaling={**zero, "kind": "keda"}))
    assert "needs router.enabled" in message
    keda_zero = bms(autoscaling={**zero, "kind": "keda"}, router={"enabled": True})
    assert violations("BaseModelServer", keda_zero) == []
    assert violations("BaseModelServer", bms(autoscaling={**zero, "minReplicas": 1}, router={"enabled": False})) == []


@pytest.mark.parametrize("name", ["Upper", "9lives", "a" * 64, "dot.ted"])
def test_server_names_are_service_names(name):
    with pytest.raises(jsonschema.ValidationError):
        validate("BaseModelServer", bms(name))
    validate("BaseModelServer", bms("smollm2-a"))


# model sources, the model cache and credentials
def rule_paths(kind: str) -> set[str]:
    return {path for path, _, _ in rules(kind)}


def one_violation(spec: dict) -> str:
    """The single message a wrong spec gets (one clear message per mistake, not a cascade)."""
    found = violations("BaseModelServer", bms(**spec))
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize(
    "model",
    [
        "smollm2-135m",
        "/models/llama-3.1-8b",
        "/models/smollm2.Q8_0.gguf",
        "hf://Qwen/Qwen3-8B",
        "hf://meta-llama/Llama-3.1-8B-Instruct@main",
        "hf://org/repo@v1.0/checkpoints/final",
        "s3://models/smollm2",
        "s3://my.models-bucket",
    ],
)
def test_cel_accepts_model_sources(model):
    assert ".spec.model" in rule_paths("BaseModelServer")  # accepted by the model rules, not for want of one
    assert violations("BaseModelServer", bms(model=model)) == []
    validate("BaseModelServer", bms(model=model))


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("models/llama", "model must be a built-in name (smollm2-135m), an absolute path"),
        ("Qwen/Qwen3-8B", "model must be a built-in name"),  # a hub id needs hf://
        ("smollm2.gguf", "model must be a built-in name"),  # a GGUF file needs its absolute path
        ("gs://bucket/model", "model must be a built-in name"),
        ("hf://Qwen", "an hf:// model looks like hf://org/repo"),
        ("hf://org/repo@", "an hf:// model looks like hf://org/repo"),
        ("s3://AB/model", "an s3:// model looks like s3://bucket/prefix"),
        ("s3://key:secret@models/x", "keys belong in credentials.s3"),
        ("/models/../etc", "must not hold '.' or '..' path segments"),
        ("s3://models/a/../b", "must not hold '.' or '..' path segments"),
    ],
)
def test_cel_rejects_wrong_model_sources(model, expected):
    assert expected in one_violation({"model": model})


@pytest.mark.parametrize(
    "draft",
    ["smollm2-135m", "/models/smollm2-135m", "/models/draft.Q8_0.gguf", "hf://HuggingFaceTB/SmolLM2-135M@main"],
)
def test_cel_accepts_draft_model_sources(draft):
    assert ".spec.engine.draftModel" in rule_paths("BaseModelServer")
    for engine in ({"speculative": "draft", "draftModel": draft}, {"draftModel": draft}):  # alone: requests opt in
        assert violations("BaseModelServer", bms(engine=engine)) == []
        validate("BaseModelServer", bms(engine=engine))


@pytest.mark.parametrize(
    ("draft", "expected"),
    [
        ("models/draft", "draftModel must be a built-in name (smollm2-135m), an absolute path"),
        ("HuggingFaceTB/SmolLM2-135M", "draftModel must be a built-in name"),
        ("gs://bucket/draft", "draftModel must be a built-in name"),
        ("hf://HuggingFaceTB", "an hf:// draftModel looks like hf://org/repo"),
        ("s3://key:secret@models/x", "keys belong in credentials.s3"),
        ("/models/../etc", "draftModel must not hold '.' or '..' path segments"),
    ],
)
def test_cel_rejects_wrong_draft_model_sources(draft, expected):
    """The draft model is refused as an invalid spec.model is, one message naming draftModel."""
    assert expected in one_violation({"engine": {"speculative": "draft", "draftModel": draft}})


def test_cel_speculative_draft_needs_a_draft_model():
    assert "draft needs engine.draftModel" in one_violation({"engine": {"speculative": "draft"}})
    for method in ("off", "ngram"):
        assert violations("BaseModelServer", bms(engine={"speculative": method})) == []
    assert violations("BaseModelServer", bms(engine={})) == []


def test_gpu_engine_fields_bounds():
    """gpuMemoryUtilization is a fraction in (0, 1]: an exclusive minimum, as OpenAPI v3.0 writes one."""
    node = schema_of("BaseModelServer")["properties"]["spec"]["properties"]["engine"]["properties"]
    assert (node["gpuMemoryUtilization"]["minimum"], node["gpuMemoryUtilization"]["exclusiveMinimum"]) == (0, True)
    assert node["gpuMemoryUtilization"]["maximum"] == 1 and node["enforceEager"]["type"] == "boolean"
    for fraction in (0.01, 0.5, 0.9, 1):
        validate("BaseModelServer", bms(engine={"gpuMemoryUtilization": fraction}))


GPU_ONLY = "applies only to GPU servers (resources.gpus > 0)"
ONE_GPU = (
    "the loraplane engine serves a model on one GPU: resources.gpus must be 0 or 1 (engine.kind vllm spreads a model "
    "over several)"
)


@pytest.mark.parametrize(
    "spec",
    [
        {"engine": {"gpuMemoryUtilization": 0.9, "enforceEager": True}},  # resources left out: gpus defaults to 1
        {"resources": {}, "engine": {"gpuMemoryUtilization": 0.5}},
        {"resources": {"requests": {"cpu": "2"}}, "engine": {"enforceEager": True}},
        {"resources": {"gpus": 1}, "engine": {"gpuMemoryUtilization": 1, "enforceEager": False}},
        {"resources": {"gpus": 0}, "engine": {"enforceEager": False}},  # false asks for nothing
        {"resources": {"gpus": 0}, "engine": {"maxLoras": 4}},
        {"resources": {"gpus": 0}},
        {"engine": {}},
    ],
)
def test_cel_accepts_gpu_settings_where_they_apply(spec):
    assert ".spec" in rule_paths("BaseModelServer")
    assert violations("BaseModelServer", bms(**spec)) == []
    validate("BaseModelServer", bms(**spec))


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (
            {"resources": {"gpus": 0}, "engine": {"gpuMemoryUtilization": 0.9}},
            f"engine.gpuMemoryUtilization {GPU_ONLY}",
        ),
        ({"resources": {"gpus": 0}, "engine": {"enforceEager": True}}, f"engine.enforceEager {GPU_ONLY}"),
        ({"resources": {"gpus": 2}}, ONE_GPU),
        ({"resources": {"gpus": 8, "requests": {"cpu": "8"}}, "engine": {"gpuMemoryUtilization": 0.9}}, ONE_GPU),
    ],
)
def test_cel_rejects_gpu_settings_that_do_not_apply(spec, expected):
    assert one_violation(spec) == expected
    validate("BaseModelServer", bms(**spec))  # the schema lets them through: the rules say why, in one line


def test_cel_gpu_rules_without_defaults():
    """The rules hold on an object the defaults did not reach (resources or gpus absent means one GPU)."""
    gpu_rules = [(r, m) for path, r, m in rules("BaseModelServer") if path == ".spec" and GPU_ONLY in m]
    (gpus_rule,) = [r for path, r, m in rules("BaseModelServer") if path == ".spec" and m == ONE_GPU]

    def broken(spec: dict) -> list[str]:
        return [m for r, m in gpu_rules if not program(r).evaluate({"self": celpy.json_to_cel(spec)})]

    settings = {"gpuMemoryUtilization": 0.9, "enforceEager": True}
    assert len(gpu_rules) == 2
    for spec in ({}, {"engine": settings}, {"resources": {}}, {"resources": {}, "engine": settings}):
        assert broken(spec) == [], spec
    assert len(broken({"resources": {"gpus": 0}, "engine": settings})) == 2
    assert program(gpus_rule).evaluate({"self": celpy.json_to_cel({})})


@pytest.mark.parametrize(
    "cache",
    [
        {},
        {"volume": "EmptyDir", "size": "40Gi"},
        {"volume": "PersistentVolumeClaim"},
        {
            "volume": "PersistentVolumeClaim",
            "size": "40Gi",
            "storageClassName": "fast",
            "accessModes": ["ReadWriteOnce"],
        },
        {"volume": "PersistentVolumeClaim", "claimName": "shared-models"},
        {"volume": "HostPath", "hostPath": "/var/lib/models", "mountPath": "/models-cache"},
    ],
)
def test_model_cache_accepted(cache):
    spec = {"model": "s3://models/smollm2", "modelCache": cache}
    assert ".spec.modelCache" in rule_paths("BaseModelServer")
    assert violations("BaseModelServer", bms(**spec)) == []
    defaulted = apply_defaults(schema_of("BaseModelServer"), bms(**spec))
    validate("BaseModelServer", defaulted)
    assert defaulted["spec"]["modelCache"]["mountPath"] == cache.get("mountPath", "/var/cache/loraplane-models")


@pytest.mark.parametrize(
    ("cache", "expected"),
    [
        ({"volume": "HostPath"}, "volume HostPath needs modelCache.hostPath"),
        ({"hostPath": "/var/lib/models"}, "hostPath is used only with volume: HostPath"),
        ({"claimName": "shared"}, "claimName names an existing claim: it needs volume: PersistentVolumeClaim"),
        (
            {"volume": "PersistentVolumeClaim", "claimName": "c", "storageClassName": "fast"},
            "storageClassName applies only",
        ),
        ({"volume": "EmptyDir", "accessModes": ["ReadWriteMany"]}, "accessModes applies only"),
        ({"volume": "HostPath", "hostPath": "/d", "size": "10Gi"}, "size is the emptyDir size limit"),
        ({"volume": "PersistentVolumeClaim", "claimName": "c", "size": "10Gi"}, "size is the emptyDir size limit"),
        ({"volume": "HostPath", "hostPath": "relative"}, "hostPath must be an absolute path"),
        ({"mountPath": "cache"}, "mountPath must be an absolute path"),
        ({"mountPath": "/var/../etc"}, "mountPath must be an absolute path without '.' or '..'"),
    ],
)
def test_model_cache_mistakes_get_one_clear_message(cache, expected):
    assert expected in one_violation({"modelCache": cache})


@pytest.mark.parametrize(
    "cache",
    [
        {"volume": "NFS"},
        {"size": "lots"},
        {"volume": "PersistentVolumeClaim", "accessModes": ["ReadWriteSometimes"]},
        {"volume": "PersistentVolumeClaim", "accessModes": []},
        {"volume": "PersistentVolumeClaim", "claimName": "Not_A_Claim"},
    ],
)
def test_model_cache_schema_rejects(cache):
    with pytest.raises(jsonschema.ValidationError):
        validate("BaseModelServer", bms(modelCache=cache))


def test_model_cache_and_credentials_defaults():
    spec = {"modelCache": {}, "credentials": {"huggingFace": {"secretName": "hf"}, "s3": {"secretName": "s3"}}}
    got = apply_defaults(schema_of("BaseModelServer"), {"spec": spec})["spec"]
    assert got["modelCache"] == {"volume": "EmptyDir", "mountPath": "/var/cache/loraplane-models"}
    assert got["credentials"]["huggingFace"] == {"secretName": "hf", "key": "HF_TOKEN"}
    assert got["credentials"]["s3"] == {
        "secretName": "s3",
        "accessKeyIdKey": "AWS_ACCESS_KEY_ID",
        "secretAccessKeyKey": "AWS_SECRET_ACCESS_KEY",
    }
    assert "modelCache" not in apply_defaults(schema_of("BaseModelServer"), {"spec": {}})["spec"]


@pytest.mark.parametrize(
    "creds",
    [
        {"huggingFace": {"secretName": "hf-token"}},
        {"huggingFace": {"endpoint": "https://hf-mirror.example.com"}},
        {"s3": {"secretName": "s3-models", "endpoint": "http://minio.storage.svc:9000", "region": "us-east-1"}},
        {"s3": {"region": "eu-west-1"}},  # keys from the pod's web identity (serviceAccountName)
    ],
)
def test_credentials_accepted(creds):
    assert {".spec.credentials.huggingFace", ".spec.credentials.s3"} <= rule_paths("BaseModelServer")
    assert violations("BaseModelServer", bms(credentials=creds)) == []
    validate("BaseModelServer", bms(credentials=creds))


@pytest.mark.parametrize(
    ("creds", "expected"),
    [
        ({"huggingFace": {}}, "credentials.huggingFace needs secretName"),
        ({"s3": {}}, "credentials.s3 needs secretName"),
        ({"s3": {"secretName": "s", "endpoint": "minio:9000"}}, "endpoint must be an http(s):// URL"),
        ({"s3": {"secretName": "s", "endpoint": "http://key:secret@minio:9000"}}, "the keys belong in the Secret"),
        ({"huggingFace": {"endpoint": "https://user:tok@hub.example.com"}}, "the token belongs in the Secret"),
    ],
)
def test_credentials_mistakes_get_one_clear_message(creds, expected):
    assert expected in one_violation({"credentials": creds})


def test_credentials_take_no_values():
    """Only Secret names and key names: a token or a key pasted into the spec is refused by the schema."""
    creds = schema_of("BaseModelServer")["properties"]["spec"]["properties"]["credentials"]
    fields = {k for side in creds["properties"].values() for k in side["properties"]}
    assert fields == {"secretName", "key", "endpoint", "accessKeyIdKey", "secretAccessKeyKey", "region"}
    assert "additionalProperties" not in creds  # structural schemas prune unknown fields such as `token`


def test_model_status_schema():
    status = {
        "model": {
            "source": "s3://models/smollm2",
            "phase": "Downloading",
            "bytesDone": 327576781,
            "bytesTotal": 536870912,
            "progress": "312.4 MiB/512.0 MiB (61%)",
            "message": "smollm2-abc: downloading, 312.4 MiB/512.0 MiB (61%)",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
        }
    }
    validate("BaseModelServer", {**bms(), "status": status})
    for phase in ("Pending", "Loading", "Ready", "Failed"):
        validate("BaseModelServer", {**bms(), "status": {"model": {**status["model"], "phase": phase}}})
    with pytest.raises(jsonschema.ValidationError):
        validate("BaseModelServer", {**bms(), "status": {"model": {"phase": "Downloaded"}}})
    draft = {**status["model"], "source": "hf://org/draft", "phase": "Pending"}
    validate("BaseModelServer", {**bms(), "status": {**status, "draftModel": draft}})
    with pytest.raises(jsonschema.ValidationError):
        validate("BaseModelServer", {**bms(), "status": {"draftModel": {"phase": "Queued"}}})


def test_model_docs_name_every_source_form():
    text = schema_of("BaseModelServer")["properties"]["spec"]["properties"]["model"]["description"]
    for form in (
        "smollm2-135m",
        "absolute path",
        ".gguf",
        "hf://org/repo[@revision][/subfolder]",
        "s3://bucket/prefix",
    ):
        assert form in text


# engine kinds: what vLLM pods take, what they refuse
VLLM_ONLY = "engine.maxCpuLoras, engine.nodes and engine.fetchImage apply to engine.kind vllm only"
NO_VLLM_EQUIVALENT = "engine.kind vllm has no equivalent of engine.hostCacheBytes"


@pytest.mark.parametrize(
    "spec",
    [
        {"engine": {"kind": "vllm"}, "resources": {"gpus": 4}},
        {"engine": {"kind": "vllm", "maxLoras": 8, "maxLoraRank": 64, "maxCpuLoras": 64}, "resources": {"gpus": 8}},
        {"engine": {"kind": "vllm", "nodes": 2, "gpuMemoryUtilization": 0.92, "dtype": "bfloat16"}},
        {"engine": {"kind": "vllm", "kvCacheGiB": 4}, "resources": {"gpus": 0}, "image": "vllm-cpu:v0.32.0"},
        {"engine": {"kind": "vllm", "fetchImage": "registry/loraplane:1.0"}, "model": "s3://models/llama-70b"},
        {"engine": {"kind": "vllm"}, "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"]},
        {"engine": {"kind": "loraplane", "maxLoras": 4}, "resources": {"gpus": 1}},
    ],
)
def test_cel_accepts_each_engine_kinds_fields(spec):
    assert violations("BaseModelServer", bms(**spec)) == []
    validate("BaseModelServer", bms(**spec))


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"engine": {"kind": "vllm", "hostCacheBytes": "2GiB"}}, NO_VLLM_EQUIVALENT),
        ({"engine": {"kind": "vllm", "quantization": "int8"}}, NO_VLLM_EQUIVALENT),
        ({"engine": {"kind": "vllm", "speculative": "ngram"}}, NO_VLLM_EQUIVALENT),
        ({"engine": {"kind": "vllm", "maxQueue": 10}}, NO_VLLM_EQUIVALENT),
        (
            {"engine": {"kind": "vllm", "kvCacheGiB": 4}, "resources": {"gpus": 2}},
            "engine.kvCacheGiB on engine.kind vllm",
        ),
        ({"engine": {"maxCpuLoras": 16}}, VLLM_ONLY),
        ({"engine": {"kind": "loraplane", "nodes": 2}}, VLLM_ONLY),
        ({"engine": {"fetchImage": "x"}}, VLLM_ONLY),
        ({"engine": {"kind": "vllm", "nodes": 2}, "resources": {"gpus": 0}, "image": "cpu"}, "engine.nodes > 1"),
        ({"engine": {"kind": "vllm"}, "resources": {"gpus": 0}}, "a CPU vLLM server"),
        ({"engine": {"kind": "vllm", "nodes": 2}, "command": ["vllm", "serve"]}, "spec.command replaces"),
        ({"resources": {"gpus": 2}}, ONE_GPU),
    ],
)
def test_cel_refuses_fields_the_engine_kind_has_no_use_for(spec, expected):
    """Each mistake gets one message naming the field and what to do instead, never a silent drop."""
    assert one_violation(spec).startswith(expected)
    validate("BaseModelServer", bms(**spec))


def test_engine_kind_is_an_enum_with_our_engine_by_default():
    node = schema_of("BaseModelServer")["properties"]["spec"]["properties"]["engine"]["properties"]["kind"]
    assert node["enum"] == ["loraplane", "vllm"] and node["default"] == "loraplane"
    with pytest.raises(jsonschema.ValidationError):
        validate("BaseModelServer", bms(engine={"kind": "sglang"}))
    spec = schema_of("BaseModelServer")["properties"]["spec"]["properties"]
    assert "default" not in spec["image"]  # the image's default depends on the kind: the operator picks it


def test_cel_refuses_an_allowlist_vllm_would_not_enforce():
    spec = {"engine": {"kind": "vllm"}, "adapterSourceAllow": ["hf://"]}
    assert one_violation(spec).startswith("adapterSourceAllow is the loraplane engine's allowlist")
