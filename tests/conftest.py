"""Shared fixtures: a real IPython shell with the extension loaded, and a private MLflow store."""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module", autouse=True)
def no_staged_data_left():
    """The ``--data`` copies a module's runs staged, and their sweeper process, go at the module's end, as at a
    kernel's exit: a later module's "no process left" checks see none of them."""
    yield
    staging = sys.modules.get("dtrain_magic.driver.staging")
    if staging is not None:
        staging.staging_area().shutdown()


# Tests whose wait overlaps the tests before them (`start_early`), by node id: what their starter yielded, or the
# exception it raised (their test re-raises it; the session goes on).
_STARTED_EARLY: dict[str, object] = {}
# Modules that count every child of this process: an early start (a kernel, a child until its test ends) must not
# be running while theirs run, so a test selected after one of them starts at its own turn.
_COUNT_EVERY_CHILD = ("test_local.py", "test_soak.py")


def pytest_configure(config):
    config.addinivalue_line("markers", "start_early(starter): the test's wait starts at the session's first test "
                            "(``starter(tmp_path_factory)``, a generator: set-up, yield, clean-up); the test gets what "
                            "it yielded from the ``started_early`` fixture and checks it where it stands")


@pytest.fixture(scope="session", autouse=True)
def start_idle_waits_early(request, tmp_path_factory):
    """A check that waits minutes on processes using no CPU (the default 120-s stall report) starts when the session
    does, so its minutes overlap the tests before it (on 2 cores, the suite's time); its test checks it as strictly,
    where it stands. Only selected tests start; each starter's clean-up runs at the session's end at the latest."""
    started = []
    counted = False
    for item in request.session.items:
        counted = counted or os.path.basename(str(item.path)) in _COUNT_EVERY_CHILD
        mark = item.get_closest_marker("start_early")
        if mark is None or counted:
            continue
        starter = mark.args[0](tmp_path_factory)
        try:
            _STARTED_EARLY[item.nodeid] = next(starter)
            started.append(starter)
        except Exception as error:  # the test reports it; every other test still runs
            _STARTED_EARLY[item.nodeid] = error
    yield
    for starter in started:
        next(starter, None)


@pytest.fixture
def started_early(request, tmp_path_factory):
    """What the test's `start_early` starter yielded: at the session's start, or now when a module that counts every
    child of this process runs before it."""
    found = _STARTED_EARLY.pop(request.node.nodeid, None)
    if found is None:
        starter = request.node.get_closest_marker("start_early").args[0](tmp_path_factory)
        found = next(starter)
        request.addfinalizer(lambda: next(starter, None))
    if isinstance(found, Exception):
        raise found
    return found


@pytest.fixture
def tracking_uri(tmp_path) -> str:
    """A fresh SQLite MLflow store for one test."""
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def shell(tmp_path, monkeypatch, tracking_uri):
    """A real IPython InteractiveShell with ``%load_ext dtrain_magic``, working in ``tmp_path``.

    ``shell.run(cell)`` runs a cell and returns IPython's ExecutionResult (``.result``, ``.error_in_exec``).
    """
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext dtrain_magic", store_history=False)

    def run(cell: str):
        return shell.run_cell(cell, store_history=True)

    shell.run = run
    yield shell
    shell.user_ns.clear()
    shell.init_user_ns()


def mlflow_client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


@pytest.fixture
def mlflow(tracking_uri):
    """An MlflowClient on the test's store."""
    return mlflow_client(tracking_uri)


@pytest.fixture
def count_calls(monkeypatch):
    """``count_calls(owner, name)``: replace ``owner.name`` (a function, or a method of a class) by one that
    records each call's arguments, in ``owner`` and, for a module's function, in every dtrain_magic module
    that imported it by name; returns the list of recorded calls."""

    def install(owner, name):
        original = getattr(owner, name)
        calls = []

        def counting(*args, **kwargs):
            calls.append(args)
            return original(*args, **kwargs)

        holders = [owner]
        if not isinstance(owner, type):
            holders += [m for m in list(sys.modules.values())
                        if getattr(m, "__name__", "").startswith("dtrain_magic") and getattr(m, name, None) is original]
        for holder in holders:
            monkeypatch.setattr(holder, name, counting)
        return calls

    return install


def pytest_collection_modifyitems(config, items):
    gpu = False
    try:
        import torch

        gpu = torch.cuda.is_available()
    except Exception:
        pass
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(pytest.mark.skip(reason="needs CUDA; this machine has none"))


sys.dont_write_bytecode = True

_MODULE_SECONDS: dict[str, float] = {}
_MODULE_CPU: dict[str, list[int]] = {}  # module -> [busy ticks, all ticks] of the whole machine while it ran
_LAST_CPU: list[tuple[int, int]] = []


def _machine_cpu_ticks() -> tuple[int, int] | None:
    """(busy, all) CPU ticks of the machine since boot (/proc/stat), None where there is none."""
    try:
        with open("/proc/stat") as handle:
            ticks = [int(value) for value in handle.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # idle and iowait are not busy


def pytest_runtest_logreport(report):
    """Add each test's setup, call and teardown time to its module's (the suite's time per module, below), and the
    machine's CPU use since the last report: how busy the cores were while the module ran says whether overlapping
    it with another could win time (a module that mostly waits) or not (one that keeps both cores busy)."""
    module = report.nodeid.split("::", 1)[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration
    now = _machine_cpu_ticks()
    if now is not None and _LAST_CPU:
        used = _MODULE_CPU.setdefault(module, [0, 0])
        used[0] += now[0] - _LAST_CPU[0][0]
        used[1] += now[1] - _LAST_CPU[0][1]
    _LAST_CPU[:] = [now] if now is not None else []


def pytest_terminal_summary(terminalreporter):
    """The suite's time per module, slowest first: where the suite's minutes go (it must stay under 60 on 2 cores)."""
    if not _MODULE_SECONDS:
        return
    terminalreporter.section("time per module (busy: the share of the machine's cores in use meanwhile)")
    for module, seconds in sorted(_MODULE_SECONDS.items(), key=lambda item: -item[1]):
        busy, ticks = _MODULE_CPU.get(module, (0, 0))
        terminalreporter.write_line(f"{seconds:8.1f} s  busy {busy / ticks if ticks else 0:4.2f}  {module}")
    terminalreporter.write_line(f"{sum(_MODULE_SECONDS.values()):8.1f} s  in all")


def pytest_sessionfinish(session, exitstatus):
    """Python waits for every non-daemon thread before it exits: one a test left blocked keeps the test command
    (and CI) running after the summary with nothing printed. Name them, so such a hang explains itself."""
    import threading

    left = [t.name for t in threading.enumerate() if t.is_alive() and not t.daemon and t is not threading.main_thread()]
    if left:
        sys.stderr.write(f"\nnon-daemon threads still alive at the end of the session (the process waits for "
                         f"them before it exits): {', '.join(left)}\n")
