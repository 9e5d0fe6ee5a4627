"""A real browser: JupyterLab on 127.0.0.1, headless Chromium (Debian package) driven by Playwright.

1. ``%%distribute --backend local -n 2 --ui`` on a small training that declares its total steps: the
   monitor panel and both live charts while training runs (the training waits half-way on a file the
   test creates once it has seen them: no race with the training's length), the per-rank output tabs and
   the Stacks button (one stack per rank with the cell's line, within 2 s) meanwhile, and after it
   finished; then Stop on a second, long run; then, in the same kernel, a sweep (``--sweep``) of 2 trials: its
   panel overlays both trials' curves in one chart and lists them in its table while the second one runs, its Stop
   trial stops that one at a step (PRUNED), and it ends with the parameters' parallel coordinates.
2. ``%%distribute --configure``: the panel shows the estimate for the cell's own model; deepspeed,
   ZeRO-2 and bf16 are picked, Run shows the monitor and both charts under the panel with points added
   over time, Stop makes the run KILLED in MLflow and ends its worker processes, "Write cell" creates
   the equivalent cell, a second Run finishes, and ``%distribute_show RUN_ID`` draws that finished run's
   charts in a fresh kernel.
3. An interactive session (``%distribute_session start``, ``%%ranks``): the session's monitor in the start cell,
   each rank's output and value, JupyterLab's interrupt on a long cell, and the next cell seeing the ranks' state.
4. A notebook with the panel executed headless (``jupyter nbconvert --execute``), opened without running a cell:
   the saved widget state alone draws the finished monitor and both final charts.

Screenshots go to ``test-output/e2e/`` (git-ignored; ``$DTRAIN_TEST_OUTPUT`` overrides) and their paths
are printed.

Setup installs what it needs: ``scripts/install_browser.sh`` (apt-get chromium when /usr/bin/chromium is
missing) and JupyterLab (pip, only when missing). Teardown shuts the server and its kernels down and
removes the temporary directories (notebook dir, Jupyter dirs, browser profile).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]

TRAIN = """%%distribute --backend local -n 2 --ui
import os, time, torch
def train(ctx):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model, opt = ctx.prepare(model, opt)
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    ctx.set_total(STEPS)
    for step in range(STEPS):
        loss = torch.nn.functional.mse_loss(model(x), y)
        ctx.backward(loss)
        grad_norm = sum(p.grad.norm().item() for p in model.parameters() if p.grad is not None)
        ctx.step()
        ctx.log(loss=loss.item(), grad_norm=grad_norm)
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}")
        time.sleep(SLEEP)
        if RELEASE and step == STEPS // 2:  # half-way: wait until the test has seen the live panel
            while not os.path.exists(RELEASE):
                time.sleep(0.05)
    return loss.item()
"""

# The --configure cell: trains until Stop, or (second Run) until the FINISH file exists. Each rank writes
# its pid, so the test can check that Stop ended the run's own worker processes.
PANEL = """%%distribute --configure --backend local -n 2
import os, time, torch
def train(ctx):
    with open(os.path.join(PIDS, f"rank{ctx.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model, opt = ctx.prepare(model, opt)
    x, y = torch.randn(32, 16), torch.randn(32, 1)
    ctx.set_total(6000)
    for step in range(6000):
        with ctx.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        ctx.backward(loss)
        ctx.step()
        ctx.log(loss=loss.item(), lr=0.01)
        time.sleep(0.05)
        if step >= 20 and os.path.exists(FINISH):
            break
    return loss.item()
"""
PANEL_PARAMS = 16 * 64 + 64 + 64 + 1


def _train_cell(steps: int, sleep: float, release: Path | None = None) -> str:
    return TRAIN.replace("STEPS", str(steps)).replace("SLEEP", str(sleep)).replace(
        "RELEASE", repr(str(release)) if release else "None")


def _write_notebook(path: Path, cells: list[str]) -> None:
    nb = {
        "cells": [{"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {}, "outputs": [],
                   "source": src} for i, src in enumerate(cells)],
        "metadata": {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
                     "language_info": {"name": "python"}},
        "nbformat": 4, "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb, indent=1))


def _notebook(root: Path) -> None:
    nb = root / "nb"
    _write_notebook(nb / "train.ipynb", [
        "%load_ext dtrain_magic",
        _train_cell(200, 0.1, nb / "release_train"),
        _train_cell(400, 0.05),
        _sweep_cell(root),
        ELASTIC.replace("KILLED", repr(str(nb / "elastic_killed"))),
    ])
    (nb / "pids").mkdir()
    _write_notebook(nb / "panel.ipynb", [
        "%load_ext dtrain_magic",
        PANEL.replace("PIDS", repr(str(nb / "pids"))).replace("FINISH", repr(str(nb / "finish_panel"))),
    ])


# The sweep cell (run after the Stop in test 1's kernel: its workers' pool, MLflow and plotly are warm): 2 one-process
# trials, one at a time; the first to reach half-way leaves a mark, the second waits there until the test saw the
# panel with both curves and the table.
SWEEP = """%%distribute -n 1 --cpu --sweep "lr=grid(0.5,0.05)" --metric loss --pruner none --parallel-trials 1
import os, time, torch
x = torch.linspace(-1, 1, 64).unsqueeze(1)
def train(ctx):
    model = torch.nn.Linear(1, 1)
    model, opt = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=ctx.params["lr"]))
    for step in range(60):  # long enough to go on past the step a Stop trial at step 15 picks (its rate on)
        loss = torch.nn.functional.mse_loss(model(x), 3 * x - 1)
        ctx.backward(loss)
        ctx.step()
        ctx.log(loss=loss.item())
        time.sleep(0.03)
        if step == 15 and os.path.exists(MARK):
            while not os.path.exists(RELEASE):
                time.sleep(0.05)
        elif step == 15:
            open(MARK, "w").close()
"""


# An elastic run (issue #37): rank 1 is SIGKILLed once at step 8, after the step-5 checkpoint; the run goes on on rank
# 0 from there (the panel's third chart: the world size, 2 then 1, and the 2 steps the shrink lost: 6 and 7).
ELASTIC = """%%distribute --backend local -n 2 --cpu --elastic 1:2
import os, signal, time, torch
def train(ctx):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    model, opt = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    ctx.load_checkpoint()
    for step in range(ctx.optimizer_steps, 30):
        if step == 8 and ctx.rank == 1 and not os.path.exists(KILLED):
            time.sleep(1.5)  # the notebook sees this step in the rank's pulse: the steps the shrink lost
            open(KILLED, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        loss = model(torch.ones(8, 4)).pow(2).mean()
        ctx.backward(loss)
        ctx.step()
        ctx.log(loss=loss.item(), step=step)
        time.sleep(0.05)
        if step % 3 == 2:
            ctx.save_checkpoint()
"""


def _check_world_chart(page, cell: int, shot: Path) -> float:
    """Run the elastic cell (number ``cell``): its monitor ends FINISHED with a third chart, the world size (2, then 1
    from the step the survivor resumed at), titled with the restarts (none: a shrink uses none) and the steps lost.
    Returns the seconds it took."""
    from playwright.sync_api import expect

    started = time.monotonic()
    page.evaluate("() => { const nb = window.jupyterapp.shell.currentWidget.content; "
                  f"nb.activeCellIndex = {cell}; window.jupyterapp.commands.execute('notebook:run-cell'); }}")
    panel = page.locator(".dtm-monitor-panel").last
    expect(panel.locator(".dtm-monitor")).to_have_attribute("data-state", "finished", timeout=120_000)
    charts = panel.locator(".dtm-charts .js-plotly-plot")
    expect(charts).to_have_count(3, timeout=60_000)
    world = charts.nth(2)
    expect(world).to_contain_text("World size: 0 restarts, 2 optimizer steps lost", timeout=30_000)
    _wait_for(lambda: world.evaluate("(el) => el.data[0].y.slice(0, 2)") == [2, 1], 30, "the world size 2, then 1")
    expect(world.locator(".scatterlayer .trace")).to_have_count(1)
    # the rank that was lost is named, not its peer (whose gloo error may end it first)
    expect(panel.locator(".dtm-log")).to_contain_text("rank 1 failed (process was killed by SIGKILL); continuing on "
                                                      "the 1 survivor(s)")
    panel.scroll_into_view_if_needed()
    page.screenshot(path=str(shot), full_page=True)
    return time.monotonic() - started


def _sweep_cell(root: Path) -> str:
    return SWEEP.replace("MARK", repr(str(root / "nb" / "sweep_mark"))).replace(
        "RELEASE", repr(str(root / "nb" / "release_sweep")))


def _check_sweep_panel(page, root: Path, cell: int, shot: Path) -> float:
    """Run the sweep cell (number ``cell``): while its second trial waits, the sweep's panel shows both trials'
    curves in one chart and both trials in the table, the best highlighted; Stop trial (clicked while the cell
    keeps the kernel busy) stops the second one at a step, PRUNED; at the end the parameters' parallel coordinates.
    Returns the seconds it took."""
    from playwright.sync_api import expect

    started = time.monotonic()
    page.evaluate("() => { const nb = window.jupyterapp.shell.currentWidget.content; "
                  f"nb.activeCellIndex = {cell}; window.jupyterapp.commands.execute('notebook:run-cell'); }}")
    panel = page.locator(".dtm-sweep-panel")
    plots, table = panel.locator(".js-plotly-plot"), panel.locator(".dtm-sweep-table")
    _wait_for(lambda: plots.first.evaluate_all("(els) => els.length && els[0].data ? els[0].data.length : 0") == 2,
              120, "two trials' curves in one chart")
    expect(table).to_contain_text("FINISHED", timeout=30_000)
    expect(table).to_contain_text("RUNNING")
    expect(table.locator("tr.dtm-best")).to_have_count(1)
    expect(plots.first.locator(".legendtext")).to_have_count(2)
    release = root / "nb" / "release_sweep"
    assert not release.exists()  # seen while the sweep runs
    panel.scroll_into_view_if_needed()
    page.screenshot(path=str(shot), full_page=True)
    panel.locator("button", has_text="Stop trial").click()  # the running trial: the dropdown's only choice
    release.touch()  # its loop goes on to the step it is asked to stop after
    expect(table).to_contain_text("PRUNED (stopped from the panel)", timeout=30_000)
    expect(plots).to_have_count(2, timeout=60_000)  # the end: parameters against the metric
    expect(plots.nth(1)).to_contain_text("parameters against loss")
    expect(table.locator("tbody tr", has_text="FINISHED")).to_have_count(1)
    return time.monotonic() - started


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def chromium() -> str:
    subprocess.run(["bash", str(REPO / "scripts" / "install_browser.sh")], check=True, timeout=600)
    assert os.access(CHROMIUM, os.X_OK), f"{CHROMIUM} missing after scripts/install_browser.sh"
    pytest.importorskip("playwright.sync_api")
    return CHROMIUM


@pytest.fixture(scope="module")
def jupyterlab():
    """A JupyterLab server on 127.0.0.1 with a token, in a temporary directory; yields (url, token, root)."""
    if importlib.util.find_spec("jupyterlab") is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "jupyterlab>=4"], check=True, timeout=600)
    root = Path(tempfile.mkdtemp(prefix="dtm_e2e_"))
    (root / "nb").mkdir()
    _notebook(root)
    token, port = os.urandom(16).hex(), _free_port()
    env = dict(os.environ)
    env.update(
        JUPYTER_CONFIG_DIR=str(root / "config"), JUPYTER_DATA_DIR=str(root / "data"),
        JUPYTER_RUNTIME_DIR=str(root / "runtime"), JUPYTERLAB_SETTINGS_DIR=str(root / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(root / "workspaces"), IPYTHONDIR=str(root / "ipython"),
        MLFLOW_TRACKING_URI=f"sqlite:///{root / 'mlflow.db'}",
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
        SPARK_LOCAL_IP="127.0.0.1", PYTHONDONTWRITEBYTECODE="1",
    )
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root / 'nb'}",
           "--ServerApp.port_retries=0", "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--LabApp.extension_manager=readonly"]
    if os.geteuid() == 0:  # containers and CI often run as root
        cmd.append("--allow-root")
    notification = root / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    notification.parent.mkdir(parents=True)
    notification.write_text('{"fetchNews": "false", "checkForUpdates": false}')  # no "news?" toast over the charts
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("JupyterLab did not start:\n" + (root / "server.log").read_text()[-3000:])
            time.sleep(0.5)
        yield url, token, root
    finally:
        try:  # shuts the kernels down too
            req = urllib.request.Request(f"{url}/api/shutdown?token={token}", method="POST")
            urllib.request.urlopen(req, timeout=10).close()
            proc.wait(timeout=20)
        except Exception:
            pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
        if os.environ.get("DTRAIN_KEEP_E2E"):
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def _launch_chromium(pw, chromium: str, profile: str, height: int = 1100):
    """Headless Chromium with a fresh profile, as every browser test here starts it (the machine's closed network
    needs `CHROMIUM_ARGS`)."""
    return pw.chromium.launch_persistent_context(profile, executable_path=chromium, headless=True, args=CHROMIUM_ARGS,
                                                 viewport={"width": 1400, "height": height})


def _output_dir() -> Path:
    out = Path(os.environ.get("DTRAIN_TEST_OUTPUT", REPO / "test-output")) / "e2e"
    out.mkdir(parents=True, exist_ok=True)
    return out


KERNEL_CONNECTED = (
    "() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
    " && window.jupyterapp.shell.currentWidget.sessionContext"
    " && window.jupyterapp.shell.currentWidget.sessionContext.session"
    " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel"
    " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.connectionStatus === 'connected'")


def _open_and_run_all(page, url: str, token: str, name: str) -> None:
    """Open ``name`` in JupyterLab (in a fresh workspace of its own: the default one would reopen the
    notebooks of an earlier test), wait for its kernel, and run every cell (without waiting for them)."""
    page.goto(f"{url}/lab/workspaces/{Path(name).stem}/tree/{name}?reset&token={token}")
    page.wait_for_function(KERNEL_CONNECTED + f" && window.jupyterapp.shell.currentWidget.context.path === {name!r}",
                           timeout=90_000)
    # resolves when every cell ran
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")


def _cell_sources(page) -> list[str]:
    return page.evaluate("() => window.jupyterapp.shell.currentWidget.content.model.sharedModel.cells"
                         ".map((c) => c.getSource())")


def _points(plot) -> int:
    """How many points the largest trace of a plotly chart holds in the browser (plotly keeps them on the div).
    Found and read in one step (``evaluate_all``): a live chart's div is replaced at each redraw, and a locator's
    ``evaluate`` that found the old one retries until a new one stays put."""
    return plot.evaluate_all("(els) => els.length && els[0].data && els[0].data.length"
                             " ? Math.max(...els[0].data.map((t) => (t.x || []).length)) : 0")


def _wait_for(predicate, timeout: float, what: str, every: float = 0.25):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


def test_panel_and_charts_in_jupyterlab(chromium, jupyterlab):
    from playwright.sync_api import expect, sync_playwright

    url, token, root = jupyterlab
    out = _output_dir()
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    profile = tempfile.mkdtemp(prefix="dtm_chromium_")
    try:
        with sync_playwright() as pw:
            context = _launch_chromium(pw, chromium, profile)
            try:
                page = context.new_page()
                _open_and_run_all(page, url, token, "train.ipynb")
                timings["lab_ready_s"] = time.monotonic() - t0

                first = page.locator(".dtm-monitor-panel").first
                monitor = first.locator(".dtm-monitor")
                expect(monitor).to_have_attribute("data-state", "running", timeout=60_000)
                timings["monitor_running_s"] = time.monotonic() - t0
                charts = first.locator(".dtm-charts .js-plotly-plot")
                # plotly's module is large: slow to load on a busy machine
                expect(charts).to_have_count(2, timeout=90_000)
                # while it trains: the progress bar moves and both charts have drawn traces
                expect(first.locator(".dtm-progress")).to_contain_text("/200", timeout=60_000)
                expect(charts.nth(0).locator(".scatterlayer .trace").first).to_be_attached(timeout=60_000)
                expect(charts.nth(1).locator(".scatterlayer .trace").first).to_be_attached(timeout=60_000)
                # the training waits half-way until the test releases it (below): it cannot have ended
                assert monitor.get_attribute("data-state") == "running", "training ended before the charts were seen"
                expect(charts.nth(0)).to_contain_text("Training metrics")
                expect(charts.nth(1)).to_contain_text("System")
                expect(first.locator(".dtm-rank-state").first).to_have_text("running")
                # per-rank output: the tabs all / rank 0 / rank 1; rank 1's tab shows its own lines, unprefixed
                expect(first.locator(".dtm-tab")).to_have_text(["all", "rank 0", "rank 1"])
                expect(first.locator(".dtm-log")).to_contain_text("[rank 1] step 0 loss")
                first.locator(".dtm-tab[data-rank='1']").click()
                expect(first.locator(".dtm-tab-active")).to_have_text("rank 1")
                expect(first.locator(".dtm-log")).to_contain_text("step 0 loss")
                assert "[rank" not in first.locator(".dtm-log").inner_text()
                first.locator(".dtm-tab[data-rank='all']").click()
                # Stacks while the cell keeps the kernel busy: one stack per rank with the cell's line, within 2 s.
                # Both ranks wait at half-way first (101 steps done), so each stack is at that wait's line.
                expect(first.locator(".dtm-progress")).to_contain_text("step 101/200", timeout=60_000)
                time.sleep(0.5)  # the other rank may still be in that step's sleep(0.1)
                clicked = time.monotonic()
                first.locator("button.dtm-stacks").click()
                stacks = first.locator(".dtm-stacks-pane")
                expect(stacks).to_contain_text("rank 1 is at Cell In[", timeout=10_000)
                timings["stacks_s"] = time.monotonic() - clicked
                expect(stacks).to_contain_text("rank 0 is at Cell In[")
                assert stacks.inner_text().count("time.sleep(0.05)") == 2, stacks.inner_text()
                assert timings["stacks_s"] < 2.0, timings["stacks_s"]
                running_shot = out / "browser_running.png"
                page.screenshot(path=str(running_shot), full_page=True)
                timings["seen_running_s"] = time.monotonic() - t0
                (root / "nb" / "release_train").touch()  # seen while running: the training may go on and end

                # after: finished, every rank done, 60/60, charts still there with the final data
                expect(monitor).to_have_attribute("data-state", "finished", timeout=120_000)
                timings["finished_s"] = time.monotonic() - t0
                expect(first.locator(".dtm-progress")).to_contain_text("step 200/200")
                expect(first.locator(".dtm-rank-state")).to_have_text(["done", "done"])
                expect(charts).to_have_count(2)
                for name in ("loss", "grad_norm"):  # every logged metric is in the legend (click to show/hide)
                    expect(charts.nth(0).locator(".legendtext", has_text=name)).to_have_count(1)
                expect(charts.nth(1)).to_contain_text("CPU / RAM")
                # the store, and how to browse it
                expect(first.locator(".dtm-link")).to_contain_text("MLflow: sqlite:///")
                expect(first.locator(".dtm-link")).to_contain_text("mlflow ui --backend-store-uri")
                expect(first.locator(".widget-html code", has_text="MLflow run ")).to_have_count(1)
                finished_shot = out / "browser_finished.png"
                first.scroll_into_view_if_needed()
                page.screenshot(path=str(finished_shot), full_page=True)

                # Stop on the second (long) run: the click must reach the kernel while the cell runs
                second = page.locator(".dtm-monitor-panel").nth(1)
                expect(second.locator(".dtm-monitor")).to_have_attribute("data-state", "running", timeout=60_000)
                # "running" comes as the workers start (before their first step): give their start time
                expect(second.locator(".dtm-progress")).to_contain_text("/400", timeout=120_000)
                clicked = time.monotonic()
                second.locator("button.dtm-stop").dispatch_event("click")  # the output keeps growing: no "stable" wait
                expect(second.locator(".dtm-monitor")).to_have_attribute("data-state", "stopped", timeout=30_000)
                timings["stop_to_stopped_s"] = time.monotonic() - clicked
                expect(page.locator(".jp-OutputArea-output")).to_contain_text(["RunInterrupted"], timeout=20_000)
                stopped_shot = out / "browser_stopped.png"
                page.screenshot(path=str(stopped_shot), full_page=True)

                # the sweep in the same kernel (run-all stopped at the interrupted cell): its panel while it runs
                sweep_shot = out / "browser_sweep.png"
                timings["sweep_s"] = _check_sweep_panel(page, root, 3, sweep_shot)
                world_shot = out / "browser_world_size.png"
                timings["elastic_s"] = _check_world_chart(page, 4, world_shot)
            finally:
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    timings["total_s"] = time.monotonic() - t0
    for shot in (running_shot, finished_shot, stopped_shot, sweep_shot, world_shot):
        assert shot.stat().st_size > 10_000
        print(f"screenshot: {shot}")
    print("browser test timings:", {k: round(v, 1) for k, v in timings.items()})


def test_configure_panel_runs_with_the_live_monitor(chromium, jupyterlab):
    """--configure → deepspeed, ZeRO-2, bf16 → Run: the monitor and both charts under the panel, growing;
    Stop → KILLED, the run's workers gone; Write cell → the equivalent cell; Run again → FINISHED; Run sweep (the
    sweep box) → two trials FINISHED in the sweep's panel under it; %distribute_show of that run in a fresh kernel
    draws its charts."""
    import psutil
    from mlflow import MlflowClient
    from playwright.sync_api import expect, sync_playwright

    url, token, root = jupyterlab
    nb = root / "nb"
    out = _output_dir()
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    timings: dict[str, float] = {}
    shots = []
    t0 = time.monotonic()
    profile = tempfile.mkdtemp(prefix="dtm_chromium_")
    try:
        with sync_playwright() as pw:
            context = _launch_chromium(pw, chromium, profile, height=1400)
            try:
                page = context.new_page()
                _open_and_run_all(page, url, token, "panel.ipynb")
                panel = page.locator(".dtm-configure").first
                expect(panel).to_be_visible(timeout=90_000)
                # the estimate is for the cell's own model, counted without training
                expect(panel.locator(".dtm-memory")).to_contain_text(f"model: {PANEL_PARAMS:,} parameters",
                                                                     timeout=30_000)
                expect(panel.locator(".dtm-memory")).to_contain_text("from the cell", timeout=30_000)
                expect(panel.locator(".dtm-control-zero select")).to_be_disabled(timeout=30_000)
                panel.locator(".dtm-control-strategy select").select_option(label="deepspeed")
                expect(panel.locator(".dtm-control-zero select")).to_be_enabled(timeout=30_000)
                panel.locator(".dtm-control-zero select").select_option(label="ZeRO-2")
                panel.locator(".dtm-control-precision select").select_option(label="bf16")
                line = "%%distribute --backend local --strategy deepspeed --zero 2 --precision bf16 -n 2 --cpu --ui"
                expect(panel.locator(".dtm-flag-line textarea")).to_have_value(line, timeout=30_000)
                expect(panel.locator(".dtm-memory")).to_contain_text("deepspeed ZeRO-2, bf16, 2 processes",
                                                                     timeout=30_000)
                expect(panel.locator("button.dtm-run")).to_be_enabled(timeout=30_000)
                panel.locator("button.dtm-run").click()
                timings["run_clicked_s"] = time.monotonic() - t0

                # the monitor under the panel: running, and both charts once the first steps are logged
                # (the first DeepSpeed run of a fresh environment compiles a C++ op first: up to a minute or more)
                monitor = panel.locator(".dtm-monitor-panel .dtm-monitor")
                expect(monitor).to_have_attribute("data-state", "running", timeout=60_000)
                # the backend in use
                expect(panel.locator(".dtm-plan")).to_contain_text("gloo process group", timeout=30_000)
                charts = panel.locator(".dtm-monitor-panel .dtm-charts .js-plotly-plot")
                expect(charts).to_have_count(2, timeout=300_000)
                expect(charts.nth(0).locator(".scatterlayer .trace").first).to_be_attached(timeout=120_000)
                expect(charts.nth(1).locator(".scatterlayer .trace").first).to_be_attached(timeout=60_000)
                timings["charts_drawn_s"] = time.monotonic() - t0
                expect(panel.locator(".dtm-progress")).to_contain_text("/6000", timeout=30_000)
                expect(panel.locator(".dtm-progress")).to_contain_text("ETA", timeout=30_000)
                expect(panel.locator(".dtm-rank-state")).to_have_text(["running", "running"], timeout=30_000)
                expect(charts.nth(0).locator(".legendtext", has_text="loss")).to_have_count(1, timeout=30_000)
                expect(charts.nth(1)).to_contain_text("CPU / RAM", timeout=30_000)
                # points are added while it trains (the run goes on until Stop: no race with its length)
                first = _wait_for(lambda: _points(charts.nth(0)), 60, "the first loss points in the browser")
                grown = _wait_for(lambda: (n := _points(charts.nth(0))) > first and n, 60, "more loss points")
                print(f"loss points in the browser: {first} -> {grown}")
                shots.append(out / "panel_running.png")
                page.screenshot(path=str(shots[-1]), full_page=True)

                # Stop: KILLED in MLflow, the run's worker processes gone, the panel can run again
                pids = [int((nb / "pids" / f"rank{r}.pid").read_text()) for r in range(2)]
                header = panel.locator(".dtm-monitor-panel .dtm-header").text_content()
                run_id = re.search(r"MLflow run ([0-9a-f]{32})", header).group(1)
                panel.locator(".dtm-monitor-panel button.dtm-stop").dispatch_event("click")
                clicked = time.monotonic()
                expect(monitor).to_have_attribute("data-state", "stopped", timeout=60_000)
                timings["stop_to_stopped_s"] = time.monotonic() - clicked
                expect(panel.locator(".dtm-monitor-panel button.dtm-stop")).to_have_text("Stopped")
                _wait_for(lambda: client.get_run(run_id).info.status == "KILLED", 60, "the run KILLED in MLflow")

                def gone(pid: int) -> bool:
                    try:
                        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
                    except psutil.NoSuchProcess:
                        return True

                _wait_for(lambda: all(gone(pid) for pid in pids), 30, f"the run's workers {pids} to exit")
                expect(panel.locator("button.dtm-run")).to_be_enabled(timeout=30_000)
                shots.append(out / "panel_stopped.png")
                page.screenshot(path=str(shots[-1]), full_page=True)

                # Write cell: the equivalent line over the cell's body, in a new cell below the panel's
                before = _cell_sources(page)
                panel.locator("button.dtm-write-cell").click()
                expect(panel.locator(".dtm-write-note")).to_contain_text("written to a new cell below", timeout=30_000)
                def one_more_cell():
                    cells = _cell_sources(page)
                    return cells if len(cells) == len(before) + 1 else None

                after = _wait_for(one_more_cell, 30, "the written cell")
                written = after[2]
                body = before[1].split("\n", 1)[1]
                assert written.startswith(line + "\n") and written.strip().endswith(body.strip()), written
                expect(page.locator(".jp-Notebook .jp-Cell").nth(2)).to_contain_text("--strategy deepspeed --zero 2",
                                                                                     timeout=30_000)

                # Run again: this time the training ends by itself (FINISHED)
                (nb / "finish_panel").touch()
                panel.locator("button.dtm-run").click()
                monitor = panel.locator(".dtm-monitor-panel .dtm-monitor")
                expect(monitor).to_have_attribute("data-state", "finished", timeout=180_000)
                expect(panel.locator(".dtm-monitor-panel button.dtm-stop")).to_have_text("Finished")
                header = panel.locator(".dtm-monitor-panel .dtm-header").text_content()
                finished_id = re.search(r"MLflow run ([0-9a-f]{32})", header).group(1)
                assert finished_id != run_id
                _wait_for(lambda: client.get_run(finished_id).info.status == "FINISHED", 60,
                          "the run FINISHED in MLflow")
                assert client.get_run(finished_id).data.params["zero"] == "2"
                assert client.get_run(finished_id).data.params["precision"] == "bf16"
                finished_charts = panel.locator(".dtm-monitor-panel .dtm-charts .js-plotly-plot")
                expect(finished_charts).to_have_count(2, timeout=120_000)
                shots.append(out / "panel_finished.png")
                page.screenshot(path=str(shots[-1]), full_page=True)

                # Run sweep: the sweep box's space and metric join the equivalent line; two trials (a seed each,
                # the cell's settings) run with the sweep's panel under the configure panel, both FINISHED
                panel.locator(".dtm-sweep-space input").fill("seed=grid(1,2)")
                panel.locator(".dtm-sweep-metric input").fill("loss")
                expect(panel.locator(".dtm-flag-line textarea")).to_have_value(
                    line + " --sweep 'seed=grid(1,2)' --metric loss", timeout=30_000)
                expect(panel.locator("button.dtm-run-sweep")).to_be_enabled()
                panel.locator("button.dtm-run-sweep").click()
                sweep_rows = panel.locator(".dtm-sweep-panel .dtm-sweep-table tbody tr")
                expect(sweep_rows).to_have_count(2, timeout=120_000)
                expect(sweep_rows.filter(has_text="FINISHED")).to_have_count(2, timeout=180_000)
                expect(panel.locator(".dtm-sweep-panel .js-plotly-plot").first).to_be_attached(timeout=60_000)
                timings["sweep_finished_s"] = time.monotonic() - t0
                shots.append(out / "panel_sweep.png")
                page.screenshot(path=str(shots[-1]), full_page=True)

                # %distribute_show in a fresh kernel: the finished run's charts, from MLflow alone
                _write_notebook(nb / "show.ipynb", ["%load_ext dtrain_magic", f"%distribute_show {finished_id}"])
                show_page = context.new_page()
                _open_and_run_all(show_page, url, token, "show.ipynb")
                shown = show_page.locator(".dtm-show")
                expect(shown).to_contain_text("FINISHED", timeout=120_000)
                shown_charts = shown.locator(".js-plotly-plot")
                expect(shown_charts).to_have_count(2, timeout=120_000)
                expect(shown_charts.nth(0).locator(".legendtext", has_text="loss")).to_have_count(1, timeout=60_000)
                expect(shown_charts.nth(1).locator(".scatterlayer .trace").first).to_be_attached(timeout=60_000)
                history = client.get_metric_history(finished_id, "loss")
                _wait_for(lambda: _points(shown_charts.nth(0)) == len(history), 60,
                          f"the {len(history)} logged loss values in the shown chart")
                shots.append(out / "show_finished.png")
                show_page.screenshot(path=str(shots[-1]), full_page=True)
            finally:
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    timings["total_s"] = time.monotonic() - t0
    for shot in shots:
        assert shot.stat().st_size > 10_000
        print(f"screenshot: {shot}")
    print("panel browser test timings:", {k: round(v, 1) for k, v in timings.items()})


# An interactive session in JupyterLab (docs/sessions.md): the start cell's monitor lists the ranks; a %%ranks cell
# shows each rank's output as its own lines and its value by rank; the kernel's interrupt (JupyterLab's, a SIGINT to
# the kernel's process group) stops a long cell on both ranks, and the next cell sees their state.
SESSION_CELLS = [
    "%load_ext dtrain_magic",
    "%distribute_session start --backend local -n 2 --cpu",
    "%%ranks\nimport os\nprint(f'hello from rank {ctx.rank}')\nctx.rank * 10",
    "%%ranks\nimport time\nn = 0\nwhile n < 100000:\n    n += 1\n    time.sleep(0.01)",
    "%%ranks\nprint(f'rank {ctx.rank} counted to {n}')",
]


def test_session_cells_show_output_by_rank(chromium, jupyterlab):
    from playwright.sync_api import expect, sync_playwright

    url, token, root = jupyterlab
    _write_notebook(root / "nb" / "session.ipynb", SESSION_CELLS)
    out = _output_dir()
    shot = out / "session_cells.png"
    t0 = time.monotonic()
    profile = tempfile.mkdtemp(prefix="dtm_chromium_")
    try:
        with sync_playwright() as pw:
            context = _launch_chromium(pw, chromium, profile)
            try:
                page = context.new_page()
                _open_and_run_all(page, url, token, "session.ipynb")
                cells = page.locator(".jp-Notebook .jp-Cell")
                # the start cell: the session's monitor, one row per rank
                monitor = cells.nth(1).locator(".dtm-monitor")
                expect(monitor).to_have_attribute("data-state", "running", timeout=90_000)
                # the cell's own output area (the monitor's charts are output areas of their own inside it)
                expect(cells.nth(1).locator(".jp-Cell-outputArea")).to_contain_text("session open", timeout=90_000)
                # a %%ranks cell: each rank's output on lines of its own, and the value by rank
                hello = cells.nth(2).locator(".jp-Cell-outputArea")
                expect(hello).to_contain_text("[rank 0] hello from rank 0", timeout=60_000)
                expect(hello).to_contain_text("[rank 1] hello from rank 1")
                expect(hello).to_contain_text("[rank 1] 10")
                # the long cell runs on both ranks: the monitor says so; JupyterLab's interrupt stops it
                expect(cells.nth(1).locator(".dtm-rank-state")).to_have_text(["running", "running"], timeout=60_000)
                interrupted_at = time.monotonic()
                page.evaluate("() => window.jupyterapp.commands.execute('notebook:interrupt-kernel')")
                interrupted = cells.nth(3).locator(".jp-Cell-outputArea")
                expect(interrupted).to_contain_text("CellInterrupted", timeout=30_000)
                back_s = time.monotonic() - interrupted_at
                expect(interrupted).to_contain_text("The session and its state are kept")
                # run all stopped at the interrupted cell: run the next one; the ranks kept their state
                page.evaluate("() => { const nb = window.jupyterapp.shell.currentWidget.content; "
                              "nb.activeCellIndex = 4; window.jupyterapp.commands.execute('notebook:run-cell'); }")
                after = cells.nth(4).locator(".jp-Cell-outputArea")
                expect(after).to_contain_text("[rank 0] rank 0 counted to", timeout=60_000)
                expect(after).to_contain_text("[rank 1] rank 1 counted to")
                expect(cells.nth(1).locator(".dtm-rank-state")).to_have_text(["idle", "idle"], timeout=30_000)
                page.screenshot(path=str(shot), full_page=True)
            finally:
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")
    print(f"session browser test: {time.monotonic() - t0:.1f} s; cell back {back_s:.1f} s after JupyterLab's interrupt")


def test_saved_notebook_shows_its_final_charts_without_its_kernel(chromium, jupyterlab, headless_notebook):
    """A notebook with the panel on, executed headless (``jupyter nbconvert --execute``, the notebook of
    tests/e2e/test_saved_notebook.py), opened in JupyterLab without running a cell: its run's kernel is gone and
    the fresh one holds none of its widgets, so what draws is the saved widget state alone: the finished
    monitor and both charts, the loss chart with every logged value."""
    from playwright.sync_api import expect, sync_playwright
    from test_saved_notebook import STEPS, logged_losses

    url, token, root = jupyterlab
    folder = root / "nb" / "headless"
    folder.mkdir()
    saved = folder / headless_notebook.path.name  # executed by the fixture (tests/e2e/conftest.py)
    shutil.copyfile(headless_notebook.path, saved)
    t0 = time.monotonic()
    # JupyterLab draws no widget of a notebook it does not trust (any notebook run elsewhere): trust it, as a
    # user does (`jupyter trust`, or File > Trust Notebook), in the server's own signature store.
    subprocess.run([sys.executable, "-m", "jupyter", "trust", str(saved)], check=True, timeout=60,
                   env={**os.environ, "JUPYTER_DATA_DIR": str(root / "data")}, capture_output=True)
    name = f"headless/{saved.name}"
    shot = _output_dir() / "saved_notebook.png"
    profile = tempfile.mkdtemp(prefix="dtm_chromium_")
    try:
        with sync_playwright() as pw:
            context = _launch_chromium(pw, chromium, profile)
            try:
                page = context.new_page()
                page.goto(f"{url}/lab/workspaces/saved/tree/{name}?reset&token={token}")
                page.wait_for_function(KERNEL_CONNECTED, timeout=90_000)  # the widgets load once a kernel is up
                panel = page.locator(".dtm-monitor-panel").first
                expect(panel.locator(".dtm-monitor")).to_have_attribute("data-state", "finished", timeout=60_000)
                charts = panel.locator(".dtm-charts .js-plotly-plot")
                expect(charts).to_have_count(2, timeout=90_000)
                expect(charts.nth(0)).to_contain_text("Training metrics")
                expect(charts.nth(1)).to_contain_text("System")
                _wait_for(lambda: _points(charts.nth(0)) == STEPS, 30, f"the {STEPS} logged loss values")
                losses = charts.nth(0).evaluate("(el) => el.data.find((t) => t.name === 'loss').y")
                assert losses == pytest.approx(logged_losses())
                page.screenshot(path=str(shot), full_page=True)
            finally:
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")
    print(f"saved notebook browser test: executed in {headless_notebook.executed_s:.1f} s (the fixture), "
          f"shown in {time.monotonic() - t0:.1f} s")

