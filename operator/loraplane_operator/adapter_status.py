"""Pure LoRAAdapter logic: what each pod should hold, which pods need a prewarm or a tier call, bounded retries
(a refusal fails at once), and the status (per-pod residency as the pods report it, ready/desired counts, phase,
conditions) aggregated from the pods' admin API rows.

The spec's tier is reached exactly until a round first finds every chosen pod there (`settledGeneration`):
a lowered tier demotes, a raised one promotes. After that it is a floor: traffic may warm the adapter further
(the engine's own cache decides) and the operator leaves it so, but promotes it back if the cache lets it
fall below the tier."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loraplane_operator import constants as c
from loraplane_server.serving.router.ranking import place

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
    found_failed: bool = False  # this round read a failed background load and counted it
    exact: bool = True  # the goal is exactly `tier` (else `tier` or warmer)

    @property
    def is_refusal(self) -> bool:
        """A failure retrying cannot change: a 4xx refusal, or a load the server says only a new source can fix
        (its row's error_transient is False: a broken adapter, a missing file; True or absent: may pass)."""
        return self.permanent or is_refused_row(self.row)

    @property
    def is_failed_attempt(self) -> bool:
        """This round counts a failure on the pod: a call that failed, or a failed load it read and acted on."""
        return self.found_failed or (self.attempted and self.condition in ("failed", "error"))

    @property
    def condition(self) -> str:
        return pod_condition(self.row, self.tier, self.error, exact=self.exact)


def goal_tier(tier: str) -> str:
    """The tier a tier call moves the adapter to: "none" (registered only) demotes to disk at most."""
    return "disk" if tier == "none" else tier


def reached(row: Row | None, tier: str, *, exact: bool = True) -> bool:
    """The pod reports the adapter settled (not loading, failed or moving to another tier) at `tier`: exactly,
    or with exact=False at `tier` or warmer. For "none" any tier will do, or with exact disk or colder."""
    if row is None or row.get("state") in ("loading", "failed"):
        return False
    if row.get("target_tier") not in (None, row.get("tier"), goal_tier(tier)):
        return False
    rank, goal = c.TIER_RANK.get(str(row.get("tier")), c.TIER_RANK["source"]), c.TIER_RANK[goal_tier(tier)]
    if tier == "none":
        return not exact or rank >= goal
    return rank == goal if exact else rank <= goal


def is_moving(row: Row | None, tier: str) -> bool:
    """The server is moving the adapter to the tier's goal (a demotion waiting for running requests)."""
    goal = goal_tier(tier)
    return row is not None and row.get("target_tier") == goal and row.get("tier") != goal


def pod_condition(row: Row | None, tier: str, error: str | None = None, *, exact: bool = True) -> str:
    """error | missing | failed | loading | ready | moving (to the tier) | off (at another tier, or never loaded)."""
    if error is not None:
        return "error"
    if row is None:
        return "missing"
    state = row.get("state")
    if state in ("failed", "loading"):
        return str(state)
    if reached(row, tier, exact=exact):
        return "ready"
    return "moving" if is_moving(row, tier) else "off"


def is_refused_row(row: Row | None) -> bool:
    """A failed load the server says only a new source can fix (error_transient False: a broken adapter, a
    missing file); True or absent: a retry may pass."""
    return row is not None and row.get("state") == "failed" and row.get("error_transient") is False


def needs_prewarm(row: Row | None, tier: str, *, force: bool, can_retry: bool) -> bool:
    """POST /v1/adapters to this pod (register with the source, load, pin)? On a spec change or a retry
    (`force`), else when unknown there or failed (unless the server calls the failure permanent), and only
    while the retry budget allows."""
    if not can_retry:
        return False
    return force or row is None or (row.get("state") == "failed" and not is_refused_row(row))


def needs_tier_call(row: Row | None, tier: str, *, exact: bool = True) -> bool:
    """POST /v1/adapters/{id}/tier: the pod reports the adapter settled off the goal (any other tier while
    `exact`, else only a colder one)."""
    return row is not None and pod_condition(row, tier, exact=exact) == "off"


def choose_tiers(pods: Sequence[str], want: AdapterWant) -> dict[str, str]:
    """The tier wanted on each pod: `want.tier` on every pod, or on the first `replicas` pods of the adapter's
    rendezvous ranking (the router's, so requests go where it is placed), the rest registered only, so every
    pod can still serve it on demand."""
    chosen = set(place(want.adapter_id, pods, want.replicas))
    return {p: (want.tier if p in chosen else "none") for p in pods}


def prewarm_pending(pod: str, pods: Sequence[str], wants: Sequence[AdapterWant], rows: Mapping[str, Row]) -> list[str]:
    """The adapters placed on `pod` (ranked among `pods`, at a tier other than none) that it does not hold at
    their tier or warmer yet: what a gated pod waits for before it joins the rotation. A failed load does not
    hold it out (its LoRAAdapter's status says why)."""
    pending = []
    for want in wants:
        tier = choose_tiers(pods, want).get(pod, "none")
        row = rows.get(want.adapter_id)
        if tier == "none" or (row is not None and row.get("state") == "failed"):
            continue
        if not reached(row, tier, exact=False):
            pending.append(want.adapter_id)
    return sorted(pending)


def backoff_s(attempts: int) -> float:
    """Delay before retry number `attempts` + 1: 5, 10, 20, 40, ... seconds, capped."""
    return min(c.BACKOFF_BASE_S * 2 ** max(attempts - 1, 0), c.BACKOFF_MAX_S)


def can_retry(attempts: int, last_attempt_age_s: float | None, *, is_failed: bool = False) -> bool:
    """May this round call the pods for the adapter? Never once Failed or out of attempts; else after the backoff."""
    if is_failed or attempts >= c.MAX_ATTEMPTS:
        return False
    return last_attempt_age_s is None or attempts == 0 or last_attempt_age_s >= backoff_s(attempts)


def next_attempts(previous: int, has_failure: bool, retried: bool, is_loading: bool = False) -> int:
    """Consecutive rounds that met a failure: reset by a clean, settled round (a load still running keeps the
    count, so a background load that fails again is counted on), counted when this round met a failure, never
    past the limit."""
    if not has_failure:
        return previous if is_loading else 0
    return min(previous + 1, c.MAX_ATTEMPTS) if retried else previous


def failed_load_action(row: Row | None, attempts: int, can_retry: bool) -> str:
    """What a round does about a pod whose background load it finds failed (the attempt behind it ended
    after the last round): "refused" (permanent: count it, never re-send), "give_up" (this failure uses the
    last attempt: count it), "retry" (count it and re-send) or "wait" (the backoff has not passed yet)."""
    if is_refused_row(row):
        return "refused"
    if attempts + 1 >= c.MAX_ATTEMPTS:
        return "give_up"
    return "retry" if can_retry else "wait"


def retry_hint(name: str, namespace: str = "") -> str:
    """How an admin retries a Failed adapter without editing its spec (the operator resets its attempts)."""
    where = f" -n {namespace}" if namespace else ""
    return f"; to retry: kubectl annotate lora {name}{where} {c.RETRY_ANNOTATION}=$(date +%s) --overwrite"


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
    conds = {r.pod: r.condition for r in results}
    targets = [r for r in results if r.tier == want.tier]
    ready = sum(conds[r.pod] == "ready" for r in targets)
    failures = [r for r in results if conds[r.pod] in ("failed", "error")]
    is_loading = any(conds[r.pod] in ("loading", "missing", "moving", "off") for r in results)
    desired = len(targets)
    if not failures:
        phase = c.PHASE_READY if ready >= desired and not is_loading else c.PHASE_LOADING
        warmer = any((r.row or {}).get("tier") != want.tier for r in targets)
        where = f"{want.tier} or warmer" if warmer and want.tier != "none" else want.tier
        message = f"at tier {where} on {ready}/{desired} pods" if phase == c.PHASE_READY else "loading"
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
    namespace: str = "",
) -> dict[str, Any]:
    """The whole LoRAAdapter status after a round over `results` (one per Ready pod of the server).
    `stay_failed`: the adapter was Failed and nobody asked for a retry: phase and message are kept (unless
    the pods now hold it as the spec says), the residency still follows the pods. `retry`: the retry
    annotation's value this round acted on."""
    s = summarize(results, want, attempts)
    phase, message = s.phase, s.message
    if stay_failed and phase != c.PHASE_READY:
        phase, message = c.PHASE_FAILED, str(previous.get("message") or "failed")
    elif phase == c.PHASE_FAILED:
        message += retry_hint(name, namespace)
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
    settled = generation if phase == c.PHASE_READY else previous.get("settledGeneration")
    if settled is not None:
        status["settledGeneration"] = settled
    for key, field in (("rank", "rank"), ("sizeBytes", "size_bytes")):
        value = next((r[field] for r in rows if r.get(field) is not None), None)
        if value is not None:
            status[key] = int(value)
    return status


def pending_status(message: str, previous: Mapping[str, Any], generation: int | None, now: str) -> dict[str, Any]:
    """No pod to talk to: the server is missing or has no Ready pod. A Failed adapter of this generation stays
    Failed (so no pod gets it again until a retry is asked), and the retry bookkeeping is kept."""
    failed = previous.get("phase") == c.PHASE_FAILED and previous.get("observedGeneration") == generation
    phase = c.PHASE_FAILED if failed else c.PHASE_PENDING
    message = str(previous.get("message") or message) if failed else message
    status: dict[str, Any] = {
        "phase": phase,
        "message": message,
        "ready": "0/0",
        "readyReplicas": 0,
        "desiredReplicas": 0,
        "residency": [],
        "pods": "",
        "conditions": [ready_condition(phase, message, generation, previous.get("conditions") or [], now)],
    }
    if generation is not None:
        status["observedGeneration"] = generation
    for key in ("attempts", "lastAttemptTime", "observedRetry", "settledGeneration"):
        if previous.get(key) is not None:
            status[key] = previous[key]
    return status


def refused_status(message: str, previous: Mapping[str, Any], generation: int | None, now: str) -> dict[str, Any]:
    """The spec asks for what the server's engine kind cannot do (a tier, pinning): Failed with the reason,
    no pod called; a spec change is the way out."""
    status = pending_status(message, {}, generation, now)
    status["phase"] = c.PHASE_FAILED
    status["conditions"] = [ready_condition(c.PHASE_FAILED, message, generation, previous.get("conditions") or [], now)]
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
        "settledGeneration",
    }
)  # fmt: skip
