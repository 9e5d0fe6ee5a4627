"""Third-party private APIs: every use sits behind a function in one module per library.

`ray`, `cloudpickle`, `mlflow`, `spark` (pyspark), `ipython`, `ipykernel`, `plotly`, `deepspeed`, `torch` and
`transformers` each name, in a `Library`, the versions their private uses were written against (the release series
of the versions in ``constraints.txt``: "2.60" stands for 2.60.0, 2.60.1, ...), and say per use what happens
on any other version:

- **required**: the magic cannot do its job without it (stopping a Ray Train run; keeping the cell's line
  numbers in a worker's traceback). `Library.require` raises a short `UnsupportedVersionError` before
  anything is launched, naming the library, the version found, the versions known and what to do: install
  a known version, or set ``DTRAIN_MAGIC_UNTESTED_VERSIONS=1`` (every library) or a list of names
  (``ray,cloudpickle``) to try this version anyway, so a patch release never locks a notebook out.
- **gated nicety**: used only on a known version (or with that opt-in), because on another one it could
  do harm (refuse a good run, break a widget); otherwise the documented fallback.
- **fallback nicety**: used whenever the attribute is there (harmless if its meaning changed); when it is
  missing, the documented fallback.

Nothing here imports the libraries at import time; versions are read from the installed distribution.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import sys
from dataclasses import dataclass

from ..errors import UnsupportedVersionError, log_dropped

OPT_IN_ENV = "DTRAIN_MAGIC_UNTESTED_VERSIONS"
_EVERY_LIBRARY = {"1", "true", "yes", "all", "*"}


@functools.lru_cache(maxsize=None)
def installed_version(distribution: str, module: str) -> str | None:
    """The installed version of ``distribution``: pip's metadata, else the module's ``__version__`` (pyspark
    on Databricks is on ``sys.path`` without metadata); None when neither says."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        loaded = sys.modules.get(module) or importlib.import_module(module)
    except Exception as exc:  # importing a broken package may raise anything: its version is then unknown
        log_dropped(__name__, "installed_version", exc)
        return None
    version = getattr(loaded, "__version__", None)
    return str(version) if version else None


def in_series(version: str, series: str) -> bool:
    """``2.60.1`` and ``2.60.0+cpu`` are in the series ``2.60``; ``2.61.0`` and ``2.6.0`` are not."""
    release = version.split("+", 1)[0]
    return release == series or release.startswith(series + ".")


def opted_in(key: str) -> bool:
    """``$DTRAIN_MAGIC_UNTESTED_VERSIONS`` asks to try unknown versions of ``key`` (or of every library)."""
    words = {word.strip().lower() for word in os.environ.get(OPT_IN_ENV, "").replace(",", " ").split()}
    return bool(words & _EVERY_LIBRARY) or key.lower() in words


@dataclass(frozen=True)
class Library:
    """The versions of one library whose private parts the magic knows."""

    key: str  # pip's name, and the name ``$DTRAIN_MAGIC_UNTESTED_VERSIONS`` lists
    title: str  # as the library writes its own name, for messages
    module: str  # the import name
    known: tuple[str, ...]  # release series written against
    tested: str  # the exact version in constraints.txt
    requirement: str  # what to pip install for a known version

    def version(self) -> str | None:
        return installed_version(self.key, self.module)

    def is_known(self) -> bool:
        version = self.version()
        return version is not None and any(in_series(version, series) for series in self.known)

    def allowed(self) -> bool:
        """A known version, or the user's opt-in: private uses may go ahead."""
        return self.is_known() or opted_in(self.key)

    def require(self, uses: str) -> None:
        """Raise `UnsupportedVersionError` unless `allowed`; ``uses`` says what depends on it."""
        if not self.allowed():
            raise UnsupportedVersionError(self.unknown_version_message(uses))

    def unknown_version_message(self, uses: str) -> str:
        found = self.version() or "a version it does not report"
        known = ", ".join(f"{series}.x" for series in self.known)
        return (
            f"{self.title} {found} is installed, and dtrain_magic relies on private parts of {self.title} ({uses}) "
            f"that it knows in {known} only (tested with {self.tested}). Install a known version "
            f"(pip install '{self.requirement}'), or set {OPT_IN_ENV}={self.key} (or =1 for every library) to try "
            f"{found} anyway. Nothing was launched"
        )

    def missing_message(self, what: str, needed_for: str) -> str:
        """For an opted-in version that lacks a required private part."""
        return (
            f"{self.title} {self.version() or '(version not reported)'} has no {what}, which dtrain_magic needs "
            f"{needed_for}; install a known version (pip install '{self.requirement}'). Nothing was launched"
        )
