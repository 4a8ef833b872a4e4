"""Rendezvous ranking of pods per adapter (serving/router/ranking.py), shared by the operator's placement and the
router: deterministic across processes, balanced, and minimal movement when pods come and go."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

from loraplane_server.serving.router.ranking import place, rank, score

ADAPTERS = [f"customer-{i:04d}" for i in range(3000)]
PODS = [f"smollm2-6d5f9c7b8-{suffix}" for suffix in ("abcde", "fghij", "klmno", "pqrst", "uvwxy")]


def test_rank_is_a_permutation_and_place_takes_its_head() -> None:
    ranked = rank("french", PODS)
    assert sorted(ranked) == sorted(PODS)
    assert place("french", PODS, 2) == ranked[:2] and place("french", PODS, None) == ranked
    assert place("french", PODS, 0) == [] and place("french", PODS, 99) == ranked
    assert rank("french", list(reversed(PODS)) + PODS[:2]) == ranked  # order and duplicates do not matter


def test_the_same_in_another_process() -> None:
    """Router replicas and the operator agree without talking: no per-process hash seed is involved."""
    code = f"from loraplane_server.serving.router.ranking import rank; print(','.join(rank('french', {PODS!r})))"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed}, capture_output=True, text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }  # fmt: skip
    assert outs == {",".join(rank("french", PODS))}


def test_first_choices_are_balanced() -> None:
    firsts = Counter(rank(a, PODS)[0] for a in ADAPTERS)
    mean = len(ADAPTERS) / len(PODS)
    assert set(firsts) == set(PODS)
    assert max(firsts.values()) <= 1.15 * mean and min(firsts.values()) >= 0.85 * mean, firsts


def test_a_pod_joining_moves_about_one_in_n() -> None:
    before = {a: place(a, PODS[:4], 1)[0] for a in ADAPTERS}
    after = {a: place(a, PODS, 1)[0] for a in ADAPTERS}
    moved = [a for a in ADAPTERS if before[a] != after[a]]
    assert all(after[a] == PODS[4] for a in moved)  # only onto the new pod, never between old ones
    assert abs(len(moved) / len(ADAPTERS) - 1 / 5) < 0.04, len(moved)


def test_a_pod_leaving_moves_only_its_own_adapters() -> None:
    gone = PODS[2]
    survivors = [p for p in PODS if p != gone]
    for a in ADAPTERS[:500]:
        before, after = place(a, PODS, 2), place(a, survivors, 2)
        if gone in before:
            kept = [p for p in before if p != gone]
            assert after[: len(kept)] == kept and after[-1] == rank(a, PODS)[2]  # the next in its ranking
        else:
            assert after == before


def test_scores_differ_per_adapter() -> None:
    assert score("a", "pod") != score("b", "pod") and score("a", "pod") == score("a", "pod")
    assert len({tuple(rank(a, PODS)) for a in ADAPTERS[:200]}) > 60  # many different orders, not one
