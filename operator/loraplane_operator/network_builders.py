"""The server pods' NetworkPolicy: who may reach their admin port (spec.networkPolicy)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kopf import Body

from loraplane_operator import builders
from loraplane_operator import constants as c
from loraplane_operator.router_builders import router_selector_labels


@dataclass(frozen=True)
class Peer:
    """The operator's own pods, as a NetworkPolicy names them: their namespace and labels."""

    namespace: str
    labels: Mapping[str, str]


def parse_labels(text: str) -> dict[str, str]:
    """'k=v,k2=v2' -> {k: v, k2: v2} (a ValueError names a malformed pair)."""
    labels: dict[str, str] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{pair!r} is not key=value")
        labels[key] = value
    return labels


def get_network_policy(bms: Body, operator: Peer | None) -> dict[str, Any] | None:
    """The server pods' NetworkPolicy (spec.networkPolicy, on by default): the API port open to all (clients, the
    kubelet's probes, Prometheus), the admin port to this server's router pods and the operator's pods only.
    None when turned off, for vLLM servers (their LoRA routes share the API port, behind its API key), and when
    the operator does not know its own pods (it runs outside the cluster: a policy would shut it out)."""
    name, spec = bms["metadata"]["name"], bms.get("spec") or {}
    if (spec.get("networkPolicy") or {}).get("enabled") is False or builders.is_vllm(spec) or operator is None:
        return None
    operator_pods: dict[str, Any] = {"podSelector": {"matchLabels": dict(operator.labels)}}
    operator_pods["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": operator.namespace}}
    policy_spec = {
        "podSelector": {"matchLabels": builders.selector_labels(name)},
        "policyTypes": ["Ingress"],
        "ingress": [
            {"ports": [{"port": c.PORT_NAME, "protocol": "TCP"}]},
            {
                "ports": [{"port": c.ADMIN_PORT_NAME, "protocol": "TCP"}],
                "from": [{"podSelector": {"matchLabels": router_selector_labels(name)}}, operator_pods],
            },
        ],
    }
    return builders.manifest("networking.k8s.io/v1", "NetworkPolicy", bms, policy_spec)
