"""Pod volumes on the process kubelet: emptyDir, hostPath and persistentVolumeClaim as host directories,
a container's mount paths translated to them, and the node's local-path provisioner.

Processes share the machine's one file system (no mount namespaces), so a volumeMount becomes real by
rewriting its mountPath, wherever it starts a path in the container's command, args, env values and
workingDir, to the volume's host directory. Other volume kinds (projected, secret, configMap, downwardAPI)
are not materialized: the kubelet's KUBECONFIG stands in for the service-account token volume.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from e2e.api import ApiClient, ApiError

PROVISIONER = "loraplane.dev/local-path"
NODE_LABEL = "loraplane.dev/local-path-node"
LOCAL_PATH_CLASSES = ("", "local-path")  # claims of these classes (or none) are provisioned by the node
DEFAULT_CLAIM_SIZE = "1Gi"


class VolumeError(RuntimeError):
    """A volume cannot be set up (yet): the pod's containers wait, with this message."""


# where each volume lives


def volume_dirs(api: ApiClient, pod: dict[str, Any], pod_dir: Path) -> dict[str, Path]:
    """Volume name -> host directory for the kinds this kubelet materializes; creates the directories."""
    namespace = pod["metadata"]["namespace"]
    dirs: dict[str, Path] = {}
    for volume in pod["spec"].get("volumes") or []:
        name = volume["name"]
        if "emptyDir" in volume:
            dirs[name] = pod_dir / "volumes" / name
        elif "hostPath" in volume:
            dirs[name] = _host_path(name, volume["hostPath"])
        elif "persistentVolumeClaim" in volume:
            dirs[name] = bound_claim_dir(api, namespace, volume["persistentVolumeClaim"]["claimName"])
        else:
            continue
        dirs[name].mkdir(parents=True, exist_ok=True)
    return dirs


def _host_path(name: str, source: dict[str, Any]) -> Path:
    path = Path(source["path"])
    kind = source.get("type", "")
    if kind == "Directory" and not path.is_dir():
        raise VolumeError(f'volume "{name}": hostPath type check failed: {path} is not a directory')
    if kind not in ("", "Directory", "DirectoryOrCreate"):
        raise VolumeError(f'volume "{name}": hostPath type {kind} is not supported by the process kubelet')
    return path


def bound_claim_dir(api: ApiClient, namespace: str, claim_name: str) -> Path:
    """The host directory of the hostPath PersistentVolume bound to the claim; VolumeError until it is bound."""
    claim = get_claim(api, namespace, claim_name)
    if claim is None:
        raise VolumeError(f'persistentvolumeclaim "{claim_name}" not found')
    phase = claim.get("status", {}).get("phase", "Pending")
    volume_name = claim["spec"].get("volumeName")
    if phase != "Bound" or not volume_name:
        raise VolumeError(f'persistentvolumeclaim "{claim_name}" is not bound yet (phase {phase})')
    volume = api.get(f"/api/v1/persistentvolumes/{volume_name}")
    host_path = volume["spec"].get("hostPath", {}).get("path")
    if not host_path:
        raise VolumeError(
            f'persistentvolume "{volume_name}" of claim "{claim_name}" is not a hostPath volume: '
            "the process kubelet mounts only hostPath volumes"
        )
    return Path(host_path)


def get_claim(api: ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return dict(api.get(f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{name}"))
    except ApiError as error:
        if error.status == 404:
            return None
        raise


# mount paths


class MountTable:
    """One container's mountPath -> host path pairs; `translate` rewrites them where a path starts."""

    def __init__(self, mounts: dict[str, Path]) -> None:
        self.mounts = {path.rstrip("/") or "/": host for path, host in mounts.items()}
        longest_first = sorted(self.mounts, key=len, reverse=True)
        # a mount path counts where it starts a path (not inside one) and ends at a separator or the end
        alternatives = "|".join(re.escape(m) for m in longest_first)
        self._pattern = re.compile(rf"(?<![\w.~/-])({alternatives})(?=/|$|[^\w.~-])") if mounts else None

    @classmethod
    def for_container(cls, spec: dict[str, Any], dirs: dict[str, Path], termination_file: Path) -> MountTable:
        mounts: dict[str, Path] = {}
        for mount in spec.get("volumeMounts") or []:
            if mount["name"] in dirs:
                host = dirs[mount["name"]] / mount.get("subPath", "")
                host.mkdir(parents=True, exist_ok=True)
                mounts[mount["mountPath"]] = host
        mounts[spec.get("terminationMessagePath") or "/dev/termination-log"] = termination_file
        return cls(mounts)

    def translate(self, text: str) -> str:
        if self._pattern is None:
            return text
        return self._pattern.sub(lambda match: str(self.mounts[match.group(1)]), text)

    def translate_spec(self, spec: dict[str, Any]) -> dict[str, Any]:
        """A copy of the container spec with command, args, env values and workingDir translated."""
        out = dict(spec)
        for key in ("command", "args"):
            if key in spec:
                out[key] = [self.translate(str(arg)) for arg in spec[key]]
        if "env" in spec:
            env = spec["env"]
            out["env"] = [{**var, "value": self.translate(var["value"])} if "value" in var else var for var in env]
        if spec.get("workingDir"):
            out["workingDir"] = self.translate(spec["workingDir"])
        return out


# the node's local-path provisioner


def claim_names(pod: dict[str, Any]) -> list[str]:
    volumes = pod["spec"].get("volumes") or []
    return [v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v]


def is_provisionable(claim: dict[str, Any]) -> bool:
    return (claim["spec"].get("storageClassName") or "") in LOCAL_PATH_CLASSES


def claim_dir(root: Path, claim: dict[str, Any]) -> Path:
    meta = claim["metadata"]
    return root / "volumes" / f"{meta['namespace']}_{meta['name']}_{meta['uid']}"


def local_path_volume(claim: dict[str, Any], node_name: str, root: Path) -> dict[str, Any]:
    """A hostPath PersistentVolume pre-bound to `claim` (the PV controller completes the binding)."""
    meta = claim["metadata"]
    spec = claim["spec"]
    size = spec.get("resources", {}).get("requests", {}).get("storage", DEFAULT_CLAIM_SIZE)
    on_node = {"key": "kubernetes.io/hostname", "operator": "In", "values": [node_name]}
    claim_ref = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": meta["namespace"]}
    claim_ref.update(name=meta["name"], uid=meta["uid"])
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {
            "name": f"pvc-{meta['uid']}",
            "labels": {NODE_LABEL: node_name},
            # names an external provisioner: the PV controller leaves deletion to it (`reclaim_released`)
            "annotations": {"pv.kubernetes.io/provisioned-by": PROVISIONER},
        },
        "spec": {
            "capacity": {"storage": size},
            "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
            "volumeMode": spec.get("volumeMode", "Filesystem"),
            "storageClassName": spec.get("storageClassName") or "",
            "persistentVolumeReclaimPolicy": "Delete",
            "hostPath": {"path": str(claim_dir(root, claim)), "type": "DirectoryOrCreate"},
            "claimRef": claim_ref,
            "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [on_node]}]}},
        },
    }


def claims_unfit_reason(api: ApiClient, pod: dict[str, Any], node_name: str, root: Path) -> str | None:
    """Why the pod's claims keep it from this node (as the scheduler says it), provisioning those it can."""
    namespace = pod["metadata"]["namespace"]
    for name in claim_names(pod):
        claim = get_claim(api, namespace, name)
        if claim is None:
            return f'0/1 nodes are available: persistentvolumeclaim "{name}" not found.'
        if claim.get("status", {}).get("phase") == "Bound":
            continue
        if not is_provisionable(claim):
            cls = claim["spec"].get("storageClassName")
            return f'0/1 nodes are available: pod has unbound PersistentVolumeClaim "{name}" (class {cls!r}).'
        provision(api, claim, node_name, root)
    return None


def provision(api: ApiClient, claim: dict[str, Any], node_name: str, root: Path) -> None:
    volume = local_path_volume(claim, node_name, root)
    Path(volume["spec"]["hostPath"]["path"]).mkdir(parents=True, exist_ok=True)
    try:
        api.create("/api/v1/persistentvolumes", volume)
    except ApiError as error:
        if error.status != 409:
            raise


def reclaim_released(api: ApiClient, node_name: str, root: Path) -> list[str]:
    """Deletes this node's Released volumes (claim gone, reclaim policy Delete) and their directories."""
    listing = api.get("/api/v1/persistentvolumes", labelSelector=f"{NODE_LABEL}={node_name}")
    deleted: list[str] = []
    for volume in listing["items"]:
        if volume.get("status", {}).get("phase") != "Released":
            continue
        if volume["spec"].get("persistentVolumeReclaimPolicy") != "Delete":
            continue
        path = Path(volume["spec"]["hostPath"]["path"])
        if path.is_relative_to(root / "volumes"):
            shutil.rmtree(path, ignore_errors=True)
        try:
            api.delete(f"/api/v1/persistentvolumes/{volume['metadata']['name']}")
            deleted.append(volume["metadata"]["name"])
        except ApiError as error:
            if error.status != 404:
                raise
    return deleted
