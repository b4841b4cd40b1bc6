"""Where d2o keeps what it makes once: converted models, downloads, extracted data."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The user cache folder of d2o: ``$XDG_CACHE_HOME/d2o`` or ``~/.cache/d2o``."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "d2o"
