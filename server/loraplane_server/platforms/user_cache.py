"""The user cache root, under which the model cache (models/), the CPU kernels' build (kernels/) and the
adapters' disk cache (adapters/) live by default."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    base = os.environ.get("LORAPLANE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "loraplane"
    )
    return Path(base)
