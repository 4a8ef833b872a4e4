"""Token usage per adapter for billing-style metrics, with a bounded label set.

At most `max_labels` adapters have their own series; everything else is counted under OTHER. An
adapter that outgrows the smallest labelled one (by lifetime tokens) takes its place; the one it
displaces stops being exported (its series goes stale) and resumes from its last value if it comes
back. So every series only ever grows, and Prometheus' rate() and increase() stay right across swaps.
"""

from __future__ import annotations

from dataclasses import dataclass

OTHER = "__other__"


@dataclass
class Usage:
    prompt_tokens: int = 0
    generated_tokens: int = 0


class AdapterUsage:
    def __init__(self, max_labels: int) -> None:
        self.max_labels = max_labels
        self.labelled: dict[str, Usage] = {}
        self.other = Usage()
        self.retired: dict[str, Usage] = {}  # displaced adapters' last exported values
        self.lifetime: dict[str, int] = {}  # adapter -> all tokens ever, for ranking

    def record(self, adapter: str, prompt_tokens: int, generated_tokens: int) -> None:
        self.lifetime[adapter] = self.lifetime.get(adapter, 0) + prompt_tokens + generated_tokens
        if adapter not in self.labelled and not self._promote(adapter):
            self.other.prompt_tokens += prompt_tokens
            self.other.generated_tokens += generated_tokens
            return
        usage = self.labelled[adapter]
        usage.prompt_tokens += prompt_tokens
        usage.generated_tokens += generated_tokens

    def _promote(self, adapter: str) -> bool:
        if len(self.labelled) >= self.max_labels:
            smallest = min(self.labelled, key=lambda a: self.lifetime[a])
            if self.lifetime[smallest] >= self.lifetime[adapter]:
                return False
            self.retired[smallest] = self.labelled.pop(smallest)
        self.labelled[adapter] = self.retired.pop(adapter, Usage())
        return True

    def series(self) -> list[tuple[str, Usage]]:
        """(label, usage) pairs to export; OTHER only once something has been aggregated."""
        rows = sorted(self.labelled.items())
        if self.other.prompt_tokens or self.other.generated_tokens:
            rows.append((OTHER, self.other))
        return rows
