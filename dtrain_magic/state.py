"""What this kernel keeps between runs, in one object: `kernel_state()`.

It holds one launcher per backend (`KernelState.launcher`) and the interactive sessions open now
(`KernelState.sessions`: closed first at exit, asked whether a run fits beside them). Each launcher keeps on
itself what it reuses from run to run: the local backend its fork server (``LocalLauncher.pool``), the Ray backend the
instance it started or the cluster it joined (``RayLauncher.instance``), the Spark backend the
SparkSession it started, never one it found (``SparkLauncher``). It also keeps the staged copies of data sources
(``keep("data", ...)``, `dtrain_magic.driver.staging`). `KernelState.shutdown` is the one place
that stops them all; it runs once at the kernel's exit.

Nothing is created when a module is imported: the state on the first `kernel_state()` call, a launcher
on its backend's first run, and what it keeps when that is first needed.
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Protocol, TypeVar


class KeptLauncher(Protocol):
    def shutdown(self, at_exit: bool = False) -> None: ...


L = TypeVar("L", bound=KeptLauncher)


class OpenSession(Protocol):
    def close(self, at_exit: bool = False) -> None: ...

    def check_beside(self, config: object) -> None: ...


class KernelState:
    """The launchers of this kernel (one per backend) and the exit hook that shuts them down."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._launchers: dict[str, KeptLauncher] = {}  # in the order they were created
        self._sessions: list[OpenSession] = []  # interactive sessions open now (`dtrain_magic.session`)
        self.last_session_end: str | None = None  # why the last session ended (said when a cell finds none)
        self._live: list = []  # the runs in progress (`driver.runner`): what %distribute_stacks and Stacks reach

    def run_started(self, run: object) -> None:
        with self._lock:
            self._live.append(run)

    def run_ended(self, run: object) -> None:
        with self._lock:
            if run in self._live:
                self._live.remove(run)

    def live_runs(self) -> list:
        """The runs in progress in this kernel, oldest first."""
        with self._lock:
            return list(self._live)

    def launcher(self, name: str, cls: type[L]) -> L:
        """The kernel's launcher for the backend ``name``, created the first time (again if its class
        changed, as after a module reload)."""
        with self._lock:
            found = self._launchers.get(name)
            if found is None or type(found) is not cls:
                self._launchers.pop(name, None)
                found = self._launchers[name] = cls()
            return found  # type: ignore[return-value]

    def keep(self, name: str, cls: type[L]) -> L:
        """What this kernel keeps besides its launchers (``"data"``: the staged data, `dtrain_magic.driver.staging`),
        created the first time and shut down with them."""
        return self.launcher(name, cls)

    def launchers(self) -> dict[str, KeptLauncher]:
        with self._lock:
            return dict(self._launchers)

    def session_opened(self, session: "OpenSession") -> None:
        with self._lock:
            self._sessions.append(session)

    def session_closed(self, session: "OpenSession", why: str) -> None:
        with self._lock:
            if session in self._sessions:
                self._sessions.remove(session)
                self.last_session_end = why

    def sessions(self) -> list["OpenSession"]:
        """The interactive sessions open in this kernel (their ranks hold processes, executor slots, Ray CPUs)."""
        with self._lock:
            return list(self._sessions)

    def stop_first_at_exit(self) -> None:
        """Make `shutdown` run before every exit hook registered so far (atexit runs them last-in,
        first-out). Launchers call it right after starting something whose library registers exit hooks
        of its own (pyspark, Ray), so that it is stopped while that library is still whole."""
        atexit.unregister(self._at_exit)
        atexit.register(self._at_exit)

    def shutdown(self, at_exit: bool = False) -> None:
        """Close the open sessions (their ranks end as a finished run's workers do, their MLflow runs end), then
        shut down what every launcher keeps, the newest first; one that fails does not stop the others.
        Launchers stay: a later run starts what it needs again."""
        for session in self.sessions():
            try:
                session.close(at_exit=at_exit)
            except Exception:  # at exit nothing may raise; the launchers below stop its ranks anyway
                logging.getLogger(__name__).warning("could not close an interactive session", exc_info=True)
        for name, launcher in reversed(list(self.launchers().items())):
            try:
                launcher.shutdown(at_exit=at_exit)
            except Exception:  # at exit nothing may raise, and each launcher still gets its turn
                logging.getLogger(__name__).warning("could not shut down the %s backend", name, exc_info=True)

    def _at_exit(self) -> None:
        self.shutdown(at_exit=True)


_state: KernelState | None = None
_state_lock = threading.Lock()


def kernel_state() -> KernelState:
    """This kernel's `KernelState`, created on first use."""
    global _state
    with _state_lock:
        if _state is None:
            _state = KernelState()
        return _state
