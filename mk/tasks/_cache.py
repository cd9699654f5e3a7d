"""mk's on-disk caches (plans, derived dependencies, generated kernels, calibrations): one
root, and the source hash that keys an entry to the code that made it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable


def cache_dir(kind: str | None = None) -> Path:
    """``$MK_CACHE_DIR`` if set, else ``~/.cache/mk``; with ``kind``, that folder in it
    (created)."""
    env = os.environ.get("MK_CACHE_DIR")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "mk"
    if kind is None:
        return root
    folder = root / kind
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def sources_hash(files: Iterable[Path]) -> str:
    """A short hash of the files' bytes, in the order given."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]
