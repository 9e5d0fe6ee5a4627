"""Where staged copies live, and for how long: the kernel's `StagingArea`.

A source that must be written once for the ranks (a Spark DataFrame, a Ray Dataset off Ray, an object from the
notebook) is staged into a fresh directory under the kernel's staging root: a private temp directory on this
machine (``dtrain_data_*`` in the system's temp dir), or ``<--data-dir>/dtrain_data_<kernel>`` when the workers do
not share this machine's files. Copies are kept by the source's identity (`Source.identity`) and where they are:
a later run of the same data, under any data name, on any backend that reads them there, reuses its copy instead
of writing it again. Each data name holds one copy: when a run gives a name other data, the copy the name held
goes (unless another name still holds it), so the disk holds at most one copy per name. A copy without an
identity goes when its run ends; every copy goes when the kernel exits, and a watchdog process
(`launchers.watchdog` ``sweep``) removes the local root even if the kernel is killed.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import threading
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from ..data.blocks import StagedSource
from ..errors import log_dropped


@dataclass
class _Copy:
    staged: StagedSource
    location: str | None  # the directory written (None: nothing on disk, e.g. Ray's object store)
    staged_s: float
    holds: Any = None  # what must stay alive while the copy is kept (a Ray Dataset: its id is the key)
    names: set[str] = field(default_factory=set)  # the data names that hold it


@dataclass
class StagingArea:
    """The kernel's staged copies, by (identity, where): kept on the kernel's state (`dtrain_magic.state`)."""

    copies: dict[tuple[str, str], _Copy] = field(default_factory=dict)
    _roots: dict[str, str] = field(default_factory=dict)  # --data-dir (or "" for the temp dir) -> this kernel's root
    _sweepers: list[Any] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def root(self, data_dir: str | None) -> str:
        """This kernel's staging root for ``data_dir`` (None: a private temp directory here), made on first use."""
        key = data_dir or ""
        with self._lock:
            if key not in self._roots:
                self._roots[key] = self._make_root(data_dir)
            return self._roots[key]

    def _make_root(self, data_dir: str | None) -> str:
        if data_dir is None:
            path = tempfile.mkdtemp(prefix="dtrain_data_")  # 0700: the user's alone
        else:
            path = _join(data_dir, f"dtrain_data_{uuid.uuid4().hex[:12]}")
            if "://" in path:
                import pyarrow.fs as pafs

                fs, inner = pafs.FileSystem.from_uri(path)
                fs.create_dir(inner, recursive=True)
                return path
            os.makedirs(path, mode=0o700)
        from ..launchers import watchdog

        # Removes the root when this process goes, however it goes; it matches no process to kill.
        self._sweepers.append(watchdog.start("sweep", f"DTRAIN_DATA_STAGING={path}", "--rmtree", path))
        return path

    def new_directory(self, data_dir: str | None) -> str:
        """A fresh directory for one copy (a URI under a remote ``--data-dir``: the writer creates it)."""
        path = _join(self.root(data_dir), uuid.uuid4().hex[:16])
        if "://" not in path:
            os.makedirs(path, mode=0o700)
        return path

    def reuse(self, name: str, identity: str | None, where: str | None) -> tuple[StagedSource, float] | None:
        """The copy of the same data an earlier run staged at ``where``, now held by ``name`` too, as ``name`` (what
        ``ctx.data(name)`` looks for: the earlier run may have called it otherwise); or None."""
        if identity is None:
            return None
        key = (identity, where or "")
        with self._lock:
            copy = self.copies.get(key)
            if copy is None:
                return None
            gone = self._hold(name, key)
        _remove_all(gone)
        return replace(copy.staged, name=name), copy.staged_s

    def keep(self, name: str, identity: str | None, where: str | None, staged: StagedSource, location: str | None,
             staged_s: float, holds: Any = None) -> None:
        """Remember the copy a run just staged for data ``name`` (removed when its run ends if it has no identity)."""
        key = (identity or f"once:{uuid.uuid4().hex}", where or "")
        with self._lock:
            held = self.copies[key].names if key in self.copies else set()
            self.copies[key] = _Copy(staged, location, staged_s, holds, held)
            gone = self._hold(name, key)
        _remove_all(gone)

    def _hold(self, name: str, key: tuple[str, str]) -> list[_Copy]:
        """``name`` now holds the copy at ``key`` only; the copies no name holds any more (to remove)."""
        self.copies[key].names.add(name)
        gone = []
        for other, copy in list(self.copies.items()):
            if other != key and name in copy.names:
                copy.names.discard(name)
                if not copy.names:
                    gone.append(self.copies.pop(other))
        return gone

    def run_ended(self) -> list[str]:
        """After a run with ``--data``: remove the copies that cannot be reused (no identity); what was removed."""
        with self._lock:
            gone = [self.copies.pop(key) for key in list(self.copies) if key[0].startswith("once:")]
        _remove_all(gone)
        return [copy.staged.name for copy in gone]

    def shutdown(self, at_exit: bool = False) -> None:
        """Remove every copy and the roots (the kernel exits)."""
        with self._lock:
            copies, roots, sweepers = list(self.copies.values()), list(self._roots.values()), list(self._sweepers)
            self.copies.clear()
            self._roots.clear()
            self._sweepers.clear()
        for copy in copies:
            remove(copy.location)
        for root in roots:
            remove(root)
        for sweeper in sweepers:  # its stdin closes: it removes its directory (already gone) and exits
            try:
                sweeper.stdin.close()
                sweeper.wait(5)
            except (OSError, subprocess.TimeoutExpired) as exc:
                log_dropped(__name__, "stopping a staging sweeper (it exits once the kernel is gone)", exc)


def _remove_all(copies: list[_Copy]) -> None:
    for copy in copies:
        remove(copy.location)


def _join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name if "://" in base else os.path.join(base, name)


def remove(location: str | None) -> None:
    """Remove a staged copy's directory (a local path or a URI); a failure is logged, never raised."""
    if not location:
        return
    try:
        if "://" in location:
            import pyarrow.fs as pafs

            fs, inner = pafs.FileSystem.from_uri(location)
            fs.delete_dir(inner)
        else:
            shutil.rmtree(location, ignore_errors=True)
    except Exception:  # rmtree or any pyarrow filesystem's error: the copy stays, the user hears where
        logging.getLogger(__name__).warning("could not remove the staged data at %s", location, exc_info=True)


def staging_area() -> StagingArea:
    """This kernel's staging area (kept on `dtrain_magic.state.kernel_state`, shut down at the kernel's exit)."""
    from ..state import kernel_state

    return kernel_state().keep("data", StagingArea)
