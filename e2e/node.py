"""The fake GPU node: its manifest, its heartbeat Lease, and whether a pod fits on it."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

GPU_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True)
class NodeConfig:
    name: str = "loraplane-node-0"
    num_gpus: int = 8
    cpu: str = "16"
    memory: str = "64Gi"
    max_pods: int = 110
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def all_labels(self) -> dict[str, str]:
        base = {"kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
        return {**base, "nvidia.com/gpu.present": "true", **self.labels}


def _now(micro: bool = False) -> str:
    now = datetime.datetime.now(datetime.timezone.utc)
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


def node_status(config: NodeConfig, kubelet_version: str) -> dict[str, Any]:
    resources = {"cpu": config.cpu, "memory": config.memory, "pods": str(config.max_pods)}
    resources[GPU_RESOURCE] = str(config.num_gpus)
    now = _now()

    def condition(kind: str, status: str, reason: str) -> dict[str, str]:
        return {"type": kind, "status": status, "reason": reason, "lastHeartbeatTime": now, "lastTransitionTime": now}

    return {
        "capacity": resources,
        "allocatable": resources,
        "conditions": [
            condition("Ready", "True", "KubeletReady"),
            condition("MemoryPressure", "False", "KubeletHasSufficientMemory"),
            condition("DiskPressure", "False", "KubeletHasNoDiskPressure"),
            condition("PIDPressure", "False", "KubeletHasSufficientPID"),
        ],
        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": config.name}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
        "nodeInfo": {
            "kubeletVersion": kubelet_version,
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": "amd64",
            "containerRuntimeVersion": "process://loraplane-e2e",
            "osImage": "loraplane process kubelet",
            "kernelVersion": "",
            "machineID": "",
            "systemUUID": "",
            "bootID": "",
        },
    }


def node_manifest(config: NodeConfig, kubelet_version: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": config.name, "labels": config.all_labels},
        "spec": {},
        "status": node_status(config, kubelet_version),
    }


def lease_manifest(node: dict[str, Any]) -> dict[str, Any]:
    name = node["metadata"]["name"]
    owner = {"apiVersion": "v1", "kind": "Node", "name": name, "uid": node["metadata"]["uid"]}
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": name, "namespace": "kube-node-lease", "ownerReferences": [owner]},
        "spec": {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": _now(micro=True)},
    }


def lease_renewal() -> dict[str, Any]:
    return {"spec": {"renewTime": _now(micro=True)}}


def num_gpus(pod: dict[str, Any]) -> int:
    total = 0
    for container in pod["spec"].get("containers", []):
        resources = container.get("resources", {})
        amount = resources.get("limits", {}).get(GPU_RESOURCE) or resources.get("requests", {}).get(GPU_RESOURCE)
        total += int(amount or 0)
    return total


def unfit_reason(config: NodeConfig, pod: dict[str, Any], pods_on_node: list[dict[str, Any]]) -> str | None:
    """Why `pod` cannot be bound to the node, or None if it fits (nodeSelector, GPUs, pod count)."""
    labels = config.all_labels
    selector = pod["spec"].get("nodeSelector", {})
    if any(labels.get(key) != value for key, value in selector.items()):
        return f"0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector {selector}."
    used = sum(num_gpus(p) for p in pods_on_node)
    if used + num_gpus(pod) > config.num_gpus:
        return f"0/1 nodes are available: 1 Insufficient {GPU_RESOURCE} ({used}/{config.num_gpus} in use)."
    if len(pods_on_node) >= config.max_pods:
        return "0/1 nodes are available: 1 Too many pods."
    return None
