"""Where scaletrain keeps what it can recompute: `$SCALETRAIN_CACHE_DIR`, else
`$XDG_CACHE_HOME/scaletrain`, else `~/.cache/scaletrain`.

Nothing kept there is ever the only copy of anything: deleting the directory costs
time at the next start (a matmul measurement, a decompression), never data.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """The cache's root directory (not created here)."""
    own = os.environ.get("SCALETRAIN_CACHE_DIR")
    if own:
        return Path(own)
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "scaletrain"
