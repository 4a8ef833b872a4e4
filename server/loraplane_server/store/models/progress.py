"""Where resolving a model stands (`Progress`), and the engine callback that carries it to /ready."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("loraplane.model")


class Progress:
    """Where resolving one model stands: its phase and bytes, for /ready (read from another thread), a bar on
    a terminal, and log lines (logger "loraplane.model") at least every 10% or 10 s otherwise."""

    def __init__(self, source: str, phase: str = "resolving") -> None:
        self.source = source
        # resolving | waiting | downloading | verifying | converting | loading | ready; a draft model's starts
        # as pending (resolve_model begins it once the model's files are in place)
        self.phase = phase
        self.bytes_done = 0  # bytes of this source's files on disk, resumed or cached ones included
        self.bytes_total: int | None = None
        self.bytes_fetched = 0  # bytes this process transferred
        self._lock = threading.Lock()
        self._bar: Any = None
        self._logged_at, self._logged_tenth = 0.0, -1

    def set_phase(self, phase: str) -> None:
        if phase != self.phase:
            log.info("model %s: %s", self.source, phase)
        with self._lock:
            self.phase = phase
            if self._bar is not None and phase != "downloading":
                self._bar.close()
                self._bar = None

    def start(self, total: int | None, done: int) -> None:
        """Downloading begins: `done` bytes of `total` are already here."""
        with self._lock:
            self.bytes_total, self.bytes_done = total, done
        self.set_phase("downloading")  # after the bytes: /ready never pairs this phase with the old ones
        with self._lock:
            if self._bar is None and sys.stderr.isatty():
                from tqdm import tqdm

                self._bar = tqdm(total=total, initial=done, unit="B", unit_scale=True, desc=self.source)
        self._log_now()

    def advance(self, nbytes: int, total: int | None = None) -> None:
        """nbytes more arrived (total: a new total, when the downloader learns it as it goes)."""
        with self._lock:
            self.bytes_done += nbytes
            self.bytes_fetched += nbytes
            self.bytes_total = total if total is not None else self.bytes_total
            if self._bar is not None:
                self._bar.total = self.bytes_total
                self._bar.update(nbytes)
        self._log_now()

    def forget(self, nbytes: int) -> None:
        """nbytes counted as done are to be fetched again (a resumed file that starts over)."""
        with self._lock:
            self.bytes_done -= nbytes
            if self._bar is not None:
                self._bar.update(-nbytes)

    def _log_now(self) -> None:
        if self._bar is not None:
            return
        tenth = self.bytes_done * 10 // self.bytes_total if self.bytes_total else -1
        if tenth > self._logged_tenth or time.monotonic() - self._logged_at >= 10:
            self._logged_at, self._logged_tenth = time.monotonic(), tenth
            log.info("model %s: %s", self.source, self.describe())

    def describe(self) -> str:
        done = f"{self.bytes_done / 2**20:.1f} MiB"
        if not self.bytes_total:
            return f"{self.phase} {done}"
        return f"{self.phase} {done}/{self.bytes_total / 2**20:.1f} MiB ({100 * self.bytes_done // self.bytes_total}%)"

    def as_dict(self) -> dict[str, object]:
        """/ready's "model" object."""
        return {
            "source": self.source,
            "phase": self.phase,
            "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total,
        }


class StartupListener:
    """An engine's on_phase callback that carries the model's Progress (and the draft model's, each its own),
    so that the HTTP server's /ready sees the downloads that LLMEngine runs (LLMEngine(config, on_phase) is
    its only channel)."""

    def __init__(
        self, on_step: Callable[[str], None], progress: Progress, draft_progress: Progress | None = None
    ) -> None:
        self.on_step = on_step
        self.progress = progress
        self.draft_progress = draft_progress

    def __call__(self, step: str) -> None:
        self.on_step(step)

    def progress_for(self, flag: str, source: str) -> Progress:
        """The Progress of the model resolved for `flag` ("--model", or "--draft-model": a listener without the
        draft's Progress gets one of its own that nothing reads, never the model's)."""
        if flag == "--draft-model":
            return self.draft_progress or Progress(source)
        return self.progress
