"""A real browser: JupyterLab on 127.0.0.1, headless Chromium (Debian package) driven by Playwright.

The notebook runs ``%%distribute --backend local -n 2 --ui`` on a small training that declares its
total steps; the test finds the monitor panel and both live charts while training runs and after it
finished, then presses Stop on a second, long run and sees it stop. Screenshots go to
``test-output/e2e/`` (git-ignored; ``$DTRAIN_TEST_OUTPUT`` overrides) and their paths are printed.

Setup installs what it needs: ``scripts/install_browser.sh`` (apt-get chromium when /usr/bin/chromium is
missing) and JupyterLab (pip, only when missing). Teardown shuts the server and its kernels down and
removes the temporary directories (notebook dir, Jupyter dirs, browser profile).
"""

from __future__ import annotations

import importlib.util
import json
import os
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

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]

TRAIN = """%%distribute --backend local -n 2 --ui
import time, torch
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
    return loss.item()
"""


def _notebook(path: Path) -> None:
    cells = [
        "%load_ext dtrain_magic",
        TRAIN.replace("STEPS", "200").replace("SLEEP", "0.1"),
        TRAIN.replace("STEPS", "400").replace("SLEEP", "0.05"),
    ]
    nb = {
        "cells": [{"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {}, "outputs": [],
                   "source": src} for i, src in enumerate(cells)],
        "metadata": {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
                     "language_info": {"name": "python"}},
        "nbformat": 4, "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb, indent=1))


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
    _notebook(root / "nb" / "train.ipynb")
    token, port = os.urandom(16).hex(), _free_port()
    env = dict(os.environ)
    env.update(
        JUPYTER_CONFIG_DIR=str(root / "config"), JUPYTER_DATA_DIR=str(root / "data"),
        JUPYTER_RUNTIME_DIR=str(root / "runtime"), JUPYTERLAB_SETTINGS_DIR=str(root / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(root / "workspaces"), IPYTHONDIR=str(root / "ipython"),
        MLFLOW_TRACKING_URI=f"sqlite:///{root / 'mlflow.db'}", PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
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


def _output_dir() -> Path:
    out = Path(os.environ.get("DTRAIN_TEST_OUTPUT", REPO / "test-output")) / "e2e"
    out.mkdir(parents=True, exist_ok=True)
    return out


def test_panel_and_charts_in_jupyterlab(chromium, jupyterlab):
    from playwright.sync_api import expect, sync_playwright

    url, token, root = jupyterlab
    out = _output_dir()
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    profile = tempfile.mkdtemp(prefix="dtm_chromium_")
    try:
        with sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                profile, executable_path=chromium, headless=True, args=CHROMIUM_ARGS,
                viewport={"width": 1400, "height": 1100},
            )
            try:
                page = context.new_page()
                page.goto(f"{url}/lab/tree/train.ipynb?token={token}")
                page.wait_for_function(
                    "() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                    " && window.jupyterapp.shell.currentWidget.sessionContext"
                    " && window.jupyterapp.shell.currentWidget.sessionContext.session"
                    " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel"
                    " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.connectionStatus === 'connected'",
                    timeout=90_000)
                timings["lab_ready_s"] = time.monotonic() - t0
                page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")  # do not await: it resolves when every cell ran

                first = page.locator(".dtm-monitor-panel").first
                monitor = first.locator(".dtm-monitor")
                expect(monitor).to_have_attribute("data-state", "running", timeout=60_000)
                timings["monitor_running_s"] = time.monotonic() - t0
                charts = first.locator(".dtm-charts .js-plotly-plot")
                expect(charts).to_have_count(2, timeout=90_000)  # plotly's module is large: slow to load on a busy machine
                # while it trains: the progress bar moves and both charts have drawn traces
                expect(first.locator(".dtm-progress")).to_contain_text("/200", timeout=60_000)
                expect(charts.nth(0).locator(".scatterlayer .trace").first).to_be_attached(timeout=60_000)
                expect(charts.nth(1).locator(".scatterlayer .trace").first).to_be_attached(timeout=60_000)
                assert monitor.get_attribute("data-state") == "running", "training ended before the charts were seen"
                expect(charts.nth(0)).to_contain_text("Training metrics")
                expect(charts.nth(1)).to_contain_text("System")
                expect(first.locator(".dtm-rank-state").first).to_have_text("running")
                running_shot = out / "browser_running.png"
                page.screenshot(path=str(running_shot), full_page=True)
                timings["seen_running_s"] = time.monotonic() - t0

                # after: finished, every rank done, 60/60, charts still there with the final data
                expect(monitor).to_have_attribute("data-state", "finished", timeout=120_000)
                timings["finished_s"] = time.monotonic() - t0
                expect(first.locator(".dtm-progress")).to_contain_text("step 200/200")
                expect(first.locator(".dtm-rank-state")).to_have_text(["done", "done"])
                expect(charts).to_have_count(2)
                for name in ("loss", "grad_norm"):  # every logged metric is in the legend (click to show/hide)
                    expect(charts.nth(0).locator(".legendtext", has_text=name)).to_have_count(1)
                expect(charts.nth(1)).to_contain_text("CPU / RAM")
                expect(first.locator(".dtm-link")).to_contain_text("MLflow: sqlite:///")  # the store, and how to browse it
                expect(first.locator(".dtm-link")).to_contain_text("mlflow ui --backend-store-uri")
                expect(first.locator(".widget-html code", has_text="MLflow run ")).to_have_count(1)
                finished_shot = out / "browser_finished.png"
                first.scroll_into_view_if_needed()
                page.screenshot(path=str(finished_shot), full_page=True)

                # Stop on the second (long) run: the click must reach the kernel while the cell runs
                second = page.locator(".dtm-monitor-panel").nth(1)
                expect(second.locator(".dtm-monitor")).to_have_attribute("data-state", "running", timeout=60_000)
                expect(second.locator(".dtm-progress")).to_contain_text("/400", timeout=30_000)
                clicked = time.monotonic()
                second.locator("button.dtm-stop").dispatch_event("click")  # the output keeps growing: no "stable" wait
                expect(second.locator(".dtm-monitor")).to_have_attribute("data-state", "stopped", timeout=30_000)
                timings["stop_to_stopped_s"] = time.monotonic() - clicked
                expect(page.locator(".jp-OutputArea-output")).to_contain_text(["RunInterrupted"], timeout=20_000)
                stopped_shot = out / "browser_stopped.png"
                page.screenshot(path=str(stopped_shot), full_page=True)
            finally:
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    timings["total_s"] = time.monotonic() - t0
    for shot in (running_shot, finished_shot, stopped_shot):
        assert shot.stat().st_size > 10_000
        print(f"screenshot: {shot}")
    print("browser test timings:", {k: round(v, 1) for k, v in timings.items()})
