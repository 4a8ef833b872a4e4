"""Pure LoRAAdapter logic: what each pod should hold, which pods need a prewarm call, and the status
(per-pod residency, ready/desired counts, phase, conditions) aggregated from the pods' admin API rows."""

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

    @property
    def is_failed_attempt(self) -> bool:
        return self.attempted and pod_condition(self.row, self.tier, self.error) in ("failed", "error")


def reached(row: Row | None, tier: str) -> bool:
    """The adapter sits at `tier` or warmer and is not loading or failed (as the server's wait_for judges)."""
    if row is None or row.get("state") in ("loading", "failed"):
        return False
    return tier == "none" or c.TIER_RANK.get(str(row.get("tier")), 3) <= c.TIER_RANK[tier]


def pod_condition(row: Row | None, tier: str, error: str | None = None) -> str:
    """error | missing | failed | loading | ready | cold (registered, never loaded to the tier)."""
    if error is not None:
        return "error"
    if row is None:
        return "missing"
    state = row.get("state")
    if state in ("failed", "loading"):
        return str(state)
    # "ready" below the tier: loaded once, then moved down by the LRU; it still serves, so no re-prewarm
    if reached(row, tier) or state == "ready":
        return "ready"
    return "cold"


def needs_prewarm(row: Row | None, tier: str, *, force: bool, can_retry: bool) -> bool:
    """POST /v1/adapters to this pod? Always when unknown or never loaded; failed loads only while retrying."""
    cond = pod_condition(row, tier)
    if cond == "failed":
        return can_retry
    return force or cond in ("missing", "cold")


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


def can_retry(attempts: int, last_attempt_age_s: float | None) -> bool:
    if attempts >= c.MAX_ATTEMPTS:
        return False
    return last_attempt_age_s is None or attempts == 0 or last_attempt_age_s >= backoff_s(attempts)


def next_attempts(previous: int, has_failure: bool, retried: bool) -> int:
    """Consecutive rounds that met a failure: reset by a clean round, counted when a call this round failed."""
    if not has_failure:
        return 0
    return previous + 1 if retried else previous


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
    is_loading = any(conds[r.pod] in ("loading", "missing", "cold") for r in results)
    desired = len(targets)
    if not failures:
        phase = c.PHASE_READY if ready >= desired and not is_loading else c.PHASE_LOADING
        message = f"at tier {want.tier} on {ready}/{desired} pods" if phase == c.PHASE_READY else "loading"
        return Summary(phase, message, ready, desired, False, is_loading)
    first = failures[0]
    reason = first.error or (first.row or {}).get("last_error") or "load failed"
    where = f"{len(failures)}/{len(results)} pods"
    if ready == 0 and attempts >= c.MAX_ATTEMPTS and not is_loading:
        # Failed only once no pod is still loading it (a pod that joined late gets its own try)
        phase, message = c.PHASE_FAILED, f"failed on {where} after {attempts} attempts: {reason}"
    elif ready == 0:
        phase, message = c.PHASE_LOADING, f"retrying (attempt {attempts}/{c.MAX_ATTEMPTS}) on {where}: {reason}"
    else:
        phase, message = c.PHASE_DEGRADED, f"failed on {where} ({first.pod}): {reason}"
    return Summary(phase, message, ready, desired, True, is_loading)


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
    attempts: int,
    last_attempt: str | None,
    generation: int | None,
    now: str,
) -> dict[str, Any]:
    """The whole LoRAAdapter status after a round over `results` (one per Ready pod of the server)."""
    s = summarize(results, want, attempts)
    rows = [r.row for r in results if r.row]
    status: dict[str, Any] = {
        "phase": s.phase,
        "message": s.message,
        "ready": f"{s.ready}/{s.desired}",
        "readyReplicas": s.ready,
        "desiredReplicas": s.desired,
        "residency": residency(results, previous.get("residency") or [], now),
        "attempts": attempts,
        "conditions": [ready_condition(s.phase, s.message, generation, previous.get("conditions") or [], now)],
    }
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
        "lastAttemptTime", "observedGeneration", "rank", "sizeBytes", "conditions",
    }
)  # fmt: skip
