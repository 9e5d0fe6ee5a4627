"""An interpreter without dtrain_magic, for the checks that refuse one (`--cluster` on a Spark session whose Python
workers could not import it)."""

from __future__ import annotations

import sys
from pathlib import Path


def bare_python(directory: Path) -> Path:
    """A script in ``directory`` that runs this machine's base Python isolated (``-S -I``: no site-packages, no
    PYTHONPATH, no current directory), so it imports nothing of the test's environment, dtrain_magic included."""
    bare = directory / "bare-python"
    bare.write_text(f"#!/bin/sh\nexec {sys.base_prefix}/bin/python3 -S -I \"$@\"\n")
    bare.chmod(0o755)
    return bare
