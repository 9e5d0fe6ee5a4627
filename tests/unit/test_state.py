"""`dtrain_magic.state`: one per-kernel object keeps the launchers (and what each keeps between runs); importing
builds nothing; one exit hook shuts everything down."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dtrain_magic import state as state_module
from dtrain_magic.state import KernelState, kernel_state


class Recorder:
    calls: list = []

    def __init__(self) -> None:
        self.name = type(self).__name__

    def shutdown(self, at_exit: bool = False) -> None:
        Recorder.calls.append((self.name, at_exit))


class First(Recorder):
    pass


class Second(Recorder):
    pass


class Broken(Recorder):
    def shutdown(self, at_exit: bool = False) -> None:
        raise RuntimeError("cannot stop")


@pytest.fixture(autouse=True)
def no_real_exit_hooks(monkeypatch):
    registered = []
    monkeypatch.setattr(state_module.atexit, "register", lambda fn: registered.append(("register", fn)))
    monkeypatch.setattr(state_module.atexit, "unregister", lambda fn: registered.append(("unregister", fn)))
    Recorder.calls = []
    return registered


def test_importing_the_package_builds_no_state_and_registers_no_exit_hook():
    """A fresh interpreter imports every module with launcher state: nothing is created or started."""
    script = (
        "import atexit, json, sys\n"
        "real, ours = atexit.register, []\n"
        "def spy(fn, *args, **kwargs):\n"
        "    if (getattr(fn, '__module__', None) or '').startswith('dtrain_magic'):\n"
        "        ours.append(repr(fn))\n"
        "    return real(fn, *args, **kwargs)\n"
        "atexit.register = spy\n"
        "import dtrain_magic, dtrain_magic.notebook.magic, dtrain_magic.driver.runner, dtrain_magic.launchers.local\n"
        "import dtrain_magic.launchers.ray, dtrain_magic.launchers.spark, dtrain_magic.state\n"
        "from dtrain_magic.launchers import get_launcher\n"
        "fresh = dtrain_magic.state._state is None\n"
        "server = get_launcher('local').pool.server_pid()  # a launcher alone starts no fork server\n"
        "print(json.dumps({'state': not fresh, 'server': server, 'hooks': ours,\n"
        "                  'heavy': sorted({'ray', 'pyspark', 'mlflow'} & set(sys.modules))}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found == {"state": False, "server": None, "hooks": [], "heavy": []}, found


def test_one_state_per_kernel_created_on_first_use(monkeypatch):
    monkeypatch.setattr(state_module, "_state", None)
    first = kernel_state()
    assert isinstance(first, KernelState) and kernel_state() is first


def test_one_launcher_per_backend_kept_until_its_class_changes():
    state = KernelState()
    first = state.launcher("a", First)
    assert state.launcher("a", First) is first
    replaced = state.launcher("a", Second)  # the module was reloaded: a new class
    assert isinstance(replaced, Second) and state.launchers() == {"a": replaced}


def test_get_launcher_returns_the_kernel_states_launcher():
    from dtrain_magic.launchers import get_launcher

    local = get_launcher("local")
    assert kernel_state().launchers()["local"] is local and get_launcher("local") is local


def test_shutdown_reaches_every_launcher_newest_first_even_past_a_failing_one():
    state = KernelState()
    state.launcher("one", First)
    state.launcher("broken", Broken)
    state.launcher("two", Second)
    state.shutdown()
    assert Recorder.calls == [("Second", False), ("First", False)]
    Recorder.calls = []
    state._at_exit()  # what the exit hook runs
    assert Recorder.calls == [("Second", True), ("First", True)]


def test_the_exit_hook_moves_before_hooks_registered_since(no_real_exit_hooks):
    state = KernelState()
    state.stop_first_at_exit()
    state.stop_first_at_exit()  # e.g. after a SparkSession started, whose library registered its own hooks
    hook = state._at_exit
    assert no_real_exit_hooks == [("unregister", hook), ("register", hook)] * 2
