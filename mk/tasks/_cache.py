"""mk's on-disk caches (plans, derived dependencies, generated kernels, calibrations): one
root, and the source hash that keys an entry to the code that made it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable


def _root() -> tuple[Path, str]:
    """The cache root and how it was chosen (``MK_CACHE_DIR=...`` or the default), for errors."""
    env = os.environ.get("MK_CACHE_DIR")
    if env:
        return Path(env).expanduser(), f"MK_CACHE_DIR={env!r}"
    root = Path.home() / ".cache" / "mk"
    return root, f"the cache folder {str(root)!r} (set MK_CACHE_DIR to use another)"


def _make(folder: Path, named: str) -> Path:
    """``folder`` created if absent; ValueError naming ``named`` when it cannot be made or is
    not a folder this process can write in."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:   # a file of that name (or in the path)
        raise ValueError(f"{named}: {str(folder)!r} is not a folder") from None
    except OSError as e:   # not a folder on the way, permission denied, a read-only disk
        raise ValueError(f"{named}: cannot make the folder {str(folder)!r}: {e.strerror or e}") from None
    if not folder.is_dir():
        raise ValueError(f"{named}: {str(folder)!r} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{named}: cannot write in the folder {str(folder)!r}")
    return folder


def cache_dir(kind: str | None = None) -> Path:
    """``$MK_CACHE_DIR`` if set, else ``~/.cache/mk``; with ``kind``, that folder in it
    (created). ValueError naming MK_CACHE_DIR (or the default) when the folder cannot be
    made or written in."""
    root, named = _root()
    if kind is None:
        return root
    return _make(root / kind, named)


def check_cache_dir() -> Path:
    """The cache root, created, once it is known to be a folder this process can write in;
    ValueError naming MK_CACHE_DIR otherwise (commands check it before any work)."""
    return _make(*_root())


def sources_hash(files: Iterable[Path]) -> str:
    """A short hash of the files' bytes, in the order given."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]
