"""Interactive sessions, really started, on local, Spark and Ray: one notebook process per backend (a real IPython
shell in its own process group, as a Jupyter kernel is) starts one session and runs every check of
`session_checks.plan` on it (state kept from cell to cell, output by rank, three cells of DDP training equal to one
``%%distribute`` run of the same code, a rank subset, a failing cell, the kernel's interrupt as Jupyter sends it,
pull and push, then each backend's own: on local a rank stuck in a collective and the restart, stop, the idle
release, the reference run beside the session, an FSDP session; on Spark the start taking the workers the reference
run left waiting; on Ray a run that does not fit beside the session), then exits with the session open: 15 s later
no process it started (tagged, tests/leftovers.py) may be alive.

The checks' outcomes come back as JSON; each is one test here, so a failure names its check (its traceback is the
notebook's own).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from leftovers import kill_tagged, new_tag, tagged_env, wait_until_none_left

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HERE = Path(__file__).resolve().parent
BACKENDS = ("local", "spark", "ray")


def checks_of(backend: str) -> list[str]:
    sys.path.insert(0, str(HERE))
    import session_checks

    return [name for name, _ in session_checks.plan(backend)]


@pytest.fixture(scope="module")
def notebooks(tmp_path_factory):
    """``notebooks(backend)``: the notebook process on ``backend`` (run once per module): its checks' results, what
    outlived it, and the process."""
    done: dict[str, tuple] = {}

    def notebook(backend: str) -> tuple:
        if backend not in done:
            done[backend] = _run_notebook(backend, tmp_path_factory.mktemp(f"session_{backend}"))
        return done[backend]

    return notebook


def _run_notebook(backend: str, root: Path) -> tuple:
    results_path = root / "results.json"
    tag = new_tag()
    env = tagged_env(tag, MLFLOW_TRACKING_URI=f"sqlite:///{root}/mlflow.db")
    env.pop("RAY_ADDRESS", None)
    started = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, str(HERE / "session_notebook.py"), backend, str(results_path)],
                              capture_output=True, text=True, cwd=root, env=env, timeout=420, start_new_session=True)
        exited = time.monotonic()
        left = wait_until_none_left(tag, within_s=15)
    finally:
        kill_tagged(tag)
    print(f"\n{backend}: notebook {exited - started:.1f} s, then {time.monotonic() - exited:.1f} s until nothing was "
          f"left\n" + "\n".join(line for line in proc.stdout.splitlines() if line.startswith(("CHECK", "VERDICT"))))
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    return results, left, proc


@pytest.mark.parametrize("backend, check", [(backend, name) for backend in BACKENDS for name in checks_of(backend)])
def test_session(notebooks, backend, check):
    results, _, proc = notebooks(backend)
    assert check in results, f"{check} did not run on {backend}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert results[check]["ok"], f"{backend}: {check} failed in the notebook:\n{results[check]['error']}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_notebook_that_exits_with_its_session_open_leaves_no_process(notebooks, backend):
    results, left, proc = notebooks(backend)
    assert "VERDICT" in proc.stdout, f"the notebook did not finish:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    last = checks_of(backend)[-1]
    assert results.get(last, {}).get("ok"), f"{backend}: the session was not open at the exit ({last} failed)"
    assert left == [], f"{backend}: processes outlived the notebook by 15 s: {left}"
