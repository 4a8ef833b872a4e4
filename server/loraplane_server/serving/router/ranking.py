"""Which server pods an adapter belongs on: rendezvous (highest random weight) hashing.

Every pod gets a score per adapter from a hash of the pair; an adapter's ranking is its pods by falling score.
The operator prewarms an adapter on the first N pods of its ranking and the router sends its requests there
first, so placement and routing agree by construction, and any number of router replicas agree with each
other without talking. When a pod joins, only the adapters for which it scores highest move to it (about
1/N of them); when one leaves, only its own adapters move, each to its next pod. Pure Python, no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def score(adapter_id: str, pod: str) -> int:
    """The pair's weight: the first 8 bytes of BLAKE2b over both names (stable across processes and
    versions, unlike hash())."""
    digest = hashlib.blake2b(f"{adapter_id}\0{pod}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank(adapter_id: str, pods: Iterable[str]) -> list[str]:
    """The pods in the adapter's order of preference (ties, which need a 64-bit collision, by name)."""
    return sorted(set(pods), key=lambda pod: (-score(adapter_id, pod), pod))


def place(adapter_id: str, pods: Iterable[str], replicas: int | None) -> list[str]:
    """The pods an adapter is placed on: the first `replicas` of its ranking, or every pod (None)."""
    ranked = rank(adapter_id, pods)
    return ranked if replicas is None else ranked[: max(replicas, 0)]
