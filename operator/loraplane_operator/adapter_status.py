"""Pure LoRAAdapter logic: what each pod should hold (exactly the spec's tier), which pods need a prewarm or a
tier call, bounded retries (a 4xx refusal fails at once), and the status (per-pod residency as the pods report
it, ready/desired counts, phase, conditions) aggregated from the pods' admin API rows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loraplane_operator import constants as c

Row = Mapping[str, Any]


@dataclass(frozen=True)
class AdapterWant:
    """A LoRAAdapter's spec, defaults applied."""

    adapter_id: str
    source: str
    tier: str = "host"
    pinned: bool = False
    replicas: int | None = None  # prewarm on this many pods; None: all


def adapter_want(name: str, spec: Mapping[str, Any]) -> AdapterWant:
    prewarm = spec.get("prewarm") or {}
    tier = prewarm.get("tier") or "host"
    replicas = prewarm.get("replicas")
    return AdapterWant(
        adapter_id=spec.get("adapterId") or name,
        source=spec["source"],
        tier=tier,
        pinned=bool(spec.get("pinned", False)),
        replicas=None if replicas is None or tier == "none" else int(replicas),
    )


@dataclass(frozen=True)
class PodResult:
    """One pod after a round: the server's row for the adapter (None if unknown there) or the call's error."""

    pod: str
    tier: str  # the tier wanted on this pod ("none": register only)
    row: Row | None = None
    error: str | None = None
    attempted: bool = False  # this round called the pod for it (a prewarm, or a read that failed)
    permanent: bool = False  # the error is a refusal that retrying cannot change (a 4xx)

    @property
    def is_refusal(self) -> bool:
        """A failure retrying cannot change: a 4xx refusal, or a load the server says only a new source can fix
        (its row's error_transient is False: a broken adapter, a missing file; True or absent: may pass)."""
        row = self.row or {}
        return self.permanent or (row.get("state") == "failed" and row.get("error_transient") is False)

    @property
    def is_failed_attempt(self) -> bool:
        return self.attempted and pod_condition(self.row, self.tier, self.error) in ("failed", "error")


def reached(row: Row | None, tier: str) -> bool:
    """The pod reports the adapter at exactly `tier`, settled (not loading, failed or moving to another tier)."""
    if row is None or row.get("state") in ("loading", "failed"):
        return False
    if tier == "none":
        return True
    return row.get("tier") == tier and row.get("target_tier") in (None, tier)


def is_moving(row: Row | None, tier: str) -> bool:
    """The server is moving the adapter to `tier` (a demotion waiting for running requests)."""
    return row is not None and tier != "none" and row.get("target_tier") == tier and row.get("tier") != tier


def pod_condition(row: Row | None, tier: str, error: str | None = None) -> str:
    """error | missing | failed | loading | ready | moving (to the tier) | off (at another tier, or never loaded)."""
    if error is not None:
        return "error"
    if row is None:
        return "missing"
    state = row.get("state")
    if state in ("failed", "loading"):
        return str(state)
    if reached(row, tier):
        return "ready"
    return "moving" if is_moving(row, tier) else "off"


def needs_prewarm(row: Row | None, tier: str, *, force: bool, can_retry: bool) -> bool:
    """POST /v1/adapters to this pod (register with the source, load, pin)? On a spec change or a retry
    (`force`), else when unknown there or failed, and only while the retry budget allows."""
    if not can_retry:
        return False
    return force or pod_condition(row, tier) in ("missing", "failed")


def needs_tier_call(row: Row | None, tier: str) -> bool:
    """POST /v1/adapters/{id}/tier: the pod reports the adapter settled at a tier other than the goal."""
    return row is not None and tier != "none" and pod_condition(row, tier) == "off"


def choose_tiers(pods: Sequence[str], rows: Mapping[str, Row | None], want: AdapterWant) -> dict[str, str]:
    """The tier wanted on each pod: `want.tier` on every pod, or on `replicas` of them (those already holding
    it first, then by name) with the rest registered only, so every pod can still serve it on demand."""
    if want.replicas is None:
        return {p: want.tier for p in pods}
    ranked = sorted(pods, key=lambda p: (not reached(rows.get(p), want.tier), p))
    chosen = set(ranked[: want.replicas])
    return {p: (want.tier if p in chosen else "none") for p in pods}


def backoff_s(attempts: int) -> float:
    """Delay before retry number `attempts` + 1: 5, 10, 20, 40, ... seconds, capped."""
    return min(c.BACKOFF_BASE_S * 2 ** max(attempts - 1, 0), c.BACKOFF_MAX_S)


def can_retry(attempts: int, last_attempt_age_s: float | None, *, is_failed: bool = False) -> bool:
    """May this round call the pods for the adapter? Never once Failed or out of attempts; else after the backoff."""
    if is_failed or attempts >= c.MAX_ATTEMPTS:
        return False
    return last_attempt_age_s is None or attempts == 0 or last_attempt_age_s >= backoff_s(attempts)


def next_attempts(previous: int, has_failure: bool, retried: bool) -> int:
    """Consecutive rounds that met a failure: reset by a clean round, counted when a call this round failed,
    never past the limit."""
    if not has_failure:
        return 0
    return min(previous + 1, c.MAX_ATTEMPTS) if retried else previous


def retry_hint(name: str) -> str:
    """How an admin retries a Failed adapter without editing its spec (the operator resets its attempts)."""
    return f"; to retry: kubectl annotate lora {name} {c.RETRY_ANNOTATION}=$(date +%s) --overwrite"


@dataclass(frozen=True)
class Summary:
    phase: str
    message: str
    ready: int
    desired: int
    has_failure: bool
    is_loading: bool


def summarize(results: Sequence[PodResult], want: AdapterWant, attempts: int) -> Summary:
    """Phase and message from the pods' conditions (no pods: Pending, set by the caller)."""
    conds = {r.pod: pod_condition(r.row, r.tier, r.error) for r in results}
    targets = [r for r in results if r.tier == want.tier]
    ready = sum(conds[r.pod] == "ready" for r in targets)
    failures = [r for r in results if conds[r.pod] in ("failed", "error")]
    is_loading = any(conds[r.pod] in ("loading", "missing", "moving", "off") for r in results)
    desired = len(targets)
    if not failures:
        phase = c.PHASE_READY if ready >= desired and not is_loading else c.PHASE_LOADING
        message = f"at tier {want.tier} on {ready}/{desired} pods" if phase == c.PHASE_READY else "loading"
        return Summary(phase, message, ready, desired, False, is_loading)
    refusals = [r for r in failures if r.is_refusal]
    first = (refusals or failures)[0]
    reason = first.error or (first.row or {}).get("last_error") or "load failed"
    where = f"{len(failures)}/{len(results)} pods"
    if ready == 0 and refusals:  # a 4xx: retrying cannot help, fail at once with the server's reason
        phase, message = c.PHASE_FAILED, f"refused on {len(refusals)}/{len(results)} pods: {reason}"
    elif ready == 0 and attempts >= c.MAX_ATTEMPTS and not is_loading:
        # Failed only once no pod is still loading it (a pod that joined late gets its own try)
        phase, message = c.PHASE_FAILED, f"failed on {where} after {attempts} attempts: {reason}"
    elif ready == 0:
        phase, message = c.PHASE_LOADING, f"retrying (attempt {attempts}/{c.MAX_ATTEMPTS}) on {where}: {reason}"
    else:
        phase, message = c.PHASE_DEGRADED, f"failed on {where} ({first.pod}): {reason}"
    return Summary(phase, message, ready, desired, True, is_loading)


def pods_column(entries: Sequence[Mapping[str, Any]]) -> str:
    """ "pod-a:device,pod-b:host": where the pods report the adapter (kubectl get lora -o wide)."""
    return ",".join(f"{e['pod']}:{e.get('tier') or 'none'}" for e in entries)


def residency(results: Sequence[PodResult], previous: Sequence[Mapping[str, Any]], now: str) -> list[dict]:
    """One entry per pod; `since` kept while the pod's tier and state are unchanged."""
    before = {e.get("pod"): e for e in previous or []}
    entries = []
    for r in sorted(results, key=lambda r: r.pod):
        row = r.row or {}
        entry: dict[str, Any] = {
            "pod": r.pod,
            "tier": str(row.get("tier") or "none"),
            "state": "error" if r.error else str(row.get("state") or "missing"),
        }
        err = r.error or row.get("last_error")
        if err:
            entry["lastError"] = str(err)[:1024]
        old = before.get(r.pod)
        same = old is not None and (old.get("tier"), old.get("state")) == (entry["tier"], entry["state"])
        entry["since"] = old.get("since", now) if same and old else now
        entries.append(entry)
    return entries


def ready_condition(phase: str, message: str, generation: int | None, previous: Sequence[Mapping], now: str) -> dict:
    """The Ready condition; lastTransitionTime moves only when its status flips."""
    status = "True" if phase == c.PHASE_READY else "False"
    old = next((x for x in previous or [] if x.get("type") == "Ready"), None)
    since = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") else now
    cond = {"type": "Ready", "status": status, "reason": phase, "message": message, "lastTransitionTime": since}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def adapter_status(
    results: Sequence[PodResult],
    want: AdapterWant,
    previous: Mapping[str, Any],
    *,
    name: str,
    attempts: int,
    last_attempt: str | None,
    generation: int | None,
    now: str,
    retry: str | None = None,
    stay_failed: bool = False,
) -> dict[str, Any]:
    """The whole LoRAAdapter status after a round over `results` (one per Ready pod of the server).
    `stay_failed`: the adapter was Failed and nobody asked for a retry: phase and message are kept, the
    residency still follows the pods. `retry`: the retry annotation's value this round acted on."""
    s = summarize(results, want, attempts)
    phase, message = s.phase, s.message
    if stay_failed:
        phase, message = c.PHASE_FAILED, str(previous.get("message") or "failed")
    elif phase == c.PHASE_FAILED:
        message += retry_hint(name)
    rows = [r.row for r in results if r.row]
    entries = residency(results, previous.get("residency") or [], now)
    status: dict[str, Any] = {
        "phase": phase,
        "message": message,
        "ready": f"{s.ready}/{s.desired}",
        "readyReplicas": s.ready,
        "desiredReplicas": s.desired,
        "residency": entries,
        "pods": pods_column(entries),
        "attempts": attempts,
        "conditions": [ready_condition(phase, message, generation, previous.get("conditions") or [], now)],
    }
    if retry is not None:
        status["observedRetry"] = retry
    if last_attempt:
        status["lastAttemptTime"] = last_attempt
    if generation is not None:
        status["observedGeneration"] = generation
    for key, field in (("rank", "rank"), ("sizeBytes", "size_bytes")):
        value = next((r[field] for r in rows if r.get(field) is not None), None)
        if value is not None:
            status[key] = int(value)
    return status


def pending_status(message: str, previous: Mapping[str, Any], generation: int | None, now: str) -> dict[str, Any]:
    """No pod to talk to yet: the server is missing or has no Ready pod."""
    status: dict[str, Any] = {
        "phase": c.PHASE_PENDING,
        "message": message,
        "ready": "0/0",
        "readyReplicas": 0,
        "desiredReplicas": 0,
        "residency": [],
        "pods": "",
        "conditions": [ready_condition(c.PHASE_PENDING, message, generation, previous.get("conditions") or [], now)],
    }
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def status_patch(current: Mapping[str, Any], desired: Mapping[str, Any], owned: frozenset[str]) -> dict[str, Any]:
    """A merge patch of the keys that differ; None removes an `owned` key the desired status no longer has."""
    patch: dict[str, Any] = {}
    for key, value in desired.items():
        old = current.get(key)
        if old == value:
            continue
        if isinstance(old, Mapping) and isinstance(value, Mapping):  # a map merges: drop vanished keys
            value = {**{k: None for k in old if k not in value}, **value}
        patch[key] = value
    for key in current:
        if key not in desired and key in owned:
            patch[key] = None
    return patch


ADAPTER_STATUS_KEYS = frozenset(
    {
        "phase", "message", "ready", "readyReplicas", "desiredReplicas", "residency", "attempts",
        "lastAttemptTime", "observedGeneration", "rank", "sizeBytes", "conditions", "pods", "observedRetry",
    }
)  # fmt: skip
