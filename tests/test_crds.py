"""The CRDs in crds/: structural schemas, valid defaults, samples that validate, printer columns and scale
paths that exist, and CEL rules that accept the samples and reject what they should (cel-python)."""

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


def validate(kind: str, obj: dict) -> None:
    jsonschema.validate(obj, strip_extensions(schema_of(kind)))


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
    assert root["properties"]["metadata"] == {"type": "object"}


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
            jsonschema.validate(node["default"], plain)
            num += 1
    assert num >= 3


def test_samples_cover_both_kinds():
    kinds = sorted(yaml.safe_load(p.read_text())["kind"] for p in SAMPLES)
    assert kinds == ["BaseModelServer", "LoRAAdapter", "LoRAAdapter", "LoRAAdapter"]
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
    }
    lora = apply_defaults(schema_of("LoRAAdapter"), {"spec": {"baseModelServer": "s", "source": "/a"}})
    assert lora["spec"]["prewarm"] == {"tier": "host"} and lora["spec"]["pinned"] is False


@pytest.mark.parametrize(
    ("kind", "patch"),
    [
        ("LoRAAdapter", {"prewarm": {"tier": "gpu"}}),
        ("LoRAAdapter", {"prewarm": {"tier": "host", "replicas": 0}}),
        ("LoRAAdapter", {"adapterId": "-bad"}),
        ("LoRAAdapter", {"baseModelServer": "Not_A_Name"}),
        ("BaseModelServer", {"replicas": -1}),
        ("BaseModelServer", {"port": 70000}),
        ("BaseModelServer", {"engine": {"dtype": "int8"}}),
        ("BaseModelServer", {"engine": {"hostCacheBytes": "lots"}}),
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
        "BaseModelServer": ["Model", "Replicas", "Ready", "Phase", "Age"],
        "LoRAAdapter": ["Server", "Phase", "Ready", "Tier", "Age"],
    }
    assert names == expected[kind]


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


def test_cel_long_names_need_an_adapter_id():
    long = lora()
    long["metadata"]["name"] = "a" * 200
    assert violations("LoRAAdapter", long)
    long["spec"]["adapterId"] = "short"
    assert violations("LoRAAdapter", long) == []


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
    assert violations("BaseModelServer", bms(autoscaling=defaulted_max))
    zero = {"enabled": True, "minReplicas": 0}
    assert any("needs kind: keda" in m for m in violations("BaseModelServer", bms(autoscaling=zero)))
    assert violations("BaseModelServer", bms(autoscaling={**zero, "kind": "keda"})) == []


@pytest.mark.parametrize("name", ["Upper", "9lives", "a" * 64, "dot.ted"])
def test_cel_server_names_are_service_names(name):
    assert violations("BaseModelServer", bms(name))
