"""A notebook on a Spark Connect session, run by test_spark_connect.py in a process of its own (a local Connect server
starts a classic SparkContext in its client's process, which cannot coexist with the suite's own SparkSession).

``python spark_connect_notebook.py OUT.json``: a real IPython shell with ``%load_ext dtrain_magic`` and a real local
Spark Connect server (``SparkSession.builder.remote("local[2]")``, started with ``PYSPARK_PYTHON`` set, as
docs/backends.md says) runs, in order, the checks the test module asserts on, each writing what it saw into OUT.json
as it ends (a check that fails records its error and the rest go on): ``local`` (a local-mode run, ``--backend
auto``), ``warm`` (the re-run on the waiting workers), ``data`` (a Connect DataFrame by ``--data``), ``interrupt`` (a
kernel interrupt), ``cluster`` (a ``--cluster`` run), ``cluster_interrupt`` (one on its waiting barrier tasks),
``released`` (``%distribute_release``, the session stopped: no torchrun process left below this process).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import threading
import time
import traceback

import psutil
from IPython.core.interactiveshell import InteractiveShell

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data_workloads import read_cell  # noqa: E402

OUT = sys.argv[1]
RESULTS: dict = {}
DATA_ROWS = 101
CELL = """%%distribute --backend {backend} -n 2 --cpu --seed 0 --no-ui {flags}
import os, torch
def train(ctx):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ctx.prepare(model, opt)
    for step in range(5):
        loss = model(torch.ones(8, 4)).pow(2).mean()
        ctx.backward(loss)
        ctx.step()
        ctx.log(loss=loss.item())
    return {{"rank": ctx.rank, "world": ctx.world_size, "pid": os.getpid(), "weight": model.module.weight.sum().item()}}
"""
SLEEP_CELL = """%%distribute --backend spark -n 2 --cpu --no-ui {flags}
import pathlib, time
def train(ctx):
    pathlib.Path({marker!r}).write_text("x")
    time.sleep(300)
"""


def torchrun_pids() -> set[int]:
    """TorchDistributor's wrapper, torchrun and its workers below this process (the Connect server's JVM is a child:
    its barrier tasks' torchrun trees too)."""
    found = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            command = " ".join(proc.cmdline())
            if proc.status() != psutil.STATUS_ZOMBIE and ("torch_run_process_wrapper" in command
                                                          or "torch.distributed.run" in command):
                found.add(proc.pid)
        except psutil.Error:
            continue
    return found


def run(shell: InteractiveShell, cell: str) -> tuple[object, str, float]:
    """(ExecutionResult, what the cell printed, seconds)."""
    buffer = io.StringIO()
    started = time.monotonic()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        result = shell.run_cell(cell, store_history=True)
    return result, buffer.getvalue(), time.monotonic() - started


def summary(result: object, out: str, seconds: float) -> dict:
    error = result.error_in_exec
    value = result.result
    return {"error": None if error is None else f"{type(error).__name__}: {error}", "out": out[-4000:],
            "seconds": round(seconds, 2), "values": getattr(value, "values", None),
            "backend": getattr(getattr(value, "config", None), "backend", None)}


def check(name: str):
    """Run the decorated check now; what it returns (or its error) goes into OUT.json under ``name``."""
    def record(fn):
        started = time.monotonic()
        try:
            RESULTS[name] = fn()
        except BaseException:  # noqa: BLE001 - recorded for the test to show
            RESULTS[name] = {"error": traceback.format_exc()[-3000:]}
        RESULTS[name]["check_s"] = round(time.monotonic() - started, 1)
        with open(OUT, "w") as handle:
            json.dump(RESULTS, handle, default=repr)
    return record


def start_session(python: str | None):
    from pyspark.sql import SparkSession

    if python is None:
        os.environ.pop("PYSPARK_PYTHON", None)
    else:
        os.environ["PYSPARK_PYTHON"] = python
    started = time.monotonic()
    # On loopback (it listens on every interface otherwise), at its fixed port 15002: one such server at a time.
    spark = (SparkSession.builder.remote("local[2]").config("spark.connect.grpc.binding.address", "127.0.0.1")
             .getOrCreate())
    RESULTS.setdefault("server_start_s", []).append(round(time.monotonic() - started, 1))
    return spark


def interrupt_when(marker: str, sent: dict) -> threading.Thread:
    """SIGINT this process (as Jupyter's interrupt does) once the run's workers wrote ``marker``."""
    def interrupt() -> None:
        deadline = time.monotonic() + 120
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        sent["pids"] = sorted(torchrun_pids())
        sent["at"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=interrupt, daemon=True)
    thread.start()
    return thread


def interrupted_run(shell: InteractiveShell, flags: str) -> dict:
    """A run interrupted while its workers sleep: how long the cell took after the SIGINT, and which of the run's
    torchrun processes were still alive 10 s after it."""
    marker = os.path.join(os.getcwd(), f"running-{time.monotonic_ns()}")
    sent: dict = {}
    thread = interrupt_when(marker, sent)
    result, out, _ = run(shell, SLEEP_CELL.format(flags=flags, marker=marker))
    returned = time.monotonic()
    thread.join(5)
    deadline = sent.get("at", 0) + 10
    while (left := set(sent.get("pids", ())) & torchrun_pids()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return {"error": type(result.error_in_exec).__name__, "out": out[-3000:], "run_pids": sent.get("pids", []),
            "taken_over": "its workers were launched ahead and waiting" in out,
            "cell_back_s": round(returned - sent.get("at", returned), 2), "left_after_10s": sorted(left)}


def wait_for_standby(launcher: object) -> list[int]:
    """The pids of the next run's waiting workers, once they are all up ([] when none waits)."""
    standby = launcher.standbys.standby
    deadline = time.monotonic() + 150
    while standby is not None and not standby.all_ready.wait(0.1) and time.monotonic() < deadline:
        pass
    return sorted(standby.pids.values()) if standby is not None else []


def notebook(python: str | None) -> tuple[InteractiveShell, object]:
    # As in a kernel, a SIGINT is a KeyboardInterrupt (a process started in the background inherits it ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext dtrain_magic", store_history=False)
    shell.user_ns["spark"] = start_session(python)
    return shell, shell.user_ns["spark"]


def main() -> None:
    from dtrain_magic._compat import spark as spark_compat
    from dtrain_magic.launchers import get_launcher

    shell, spark = notebook(sys.executable)
    launcher = get_launcher("spark")
    # What --cluster's refusal reads (tests/unit/test_spark_connect_logic.py refuses on None): the server's own value.
    RESULTS["server_python"] = spark_compat.connect_server_python()

    @check("local")
    def _local() -> dict:
        return summary(*run(shell, CELL.format(backend="auto", flags="")))

    @check("warm")
    def _warm() -> dict:
        waiting = wait_for_standby(launcher)
        claims = launcher.standbys.claims
        found = summary(*run(shell, CELL.format(backend="spark", flags="")))
        found.update(waiting=waiting, claimed=launcher.standbys.claims - claims, session_starts=launcher.session_starts)
        return found

    @check("data")
    def _data() -> dict:
        shell.user_ns["df"] = spark.range(DATA_ROWS).selectExpr("id", "cast(id as float) as x").repartition(3)
        options = {"batch_size": 4, "shuffle": True}
        return summary(*run(shell, read_cell("spark", {"train": options}, flags="--data train=df[id,x]")))

    @check("interrupt")
    def _interrupt() -> dict:
        return interrupted_run(shell, "")

    @check("cluster")
    def _cluster() -> dict:
        shell.run_cell("%distribute_release", store_history=False)  # (the placement changes: they would go anyway)
        # Held on the user's session only when asked: the interrupted run below takes these barrier tasks over.
        return summary(*run(shell, CELL.format(backend="spark", flags="--cluster --keep-warm 300")))

    @check("cluster_interrupt")
    def _cluster_interrupt() -> dict:
        waiting = wait_for_standby(launcher)
        found = interrupted_run(shell, "--cluster --keep-warm 0")
        found.update(waiting=waiting, standby_left=launcher.standbys.standby is not None)
        return found

    @check("released")
    def _released() -> dict:
        shell.run_cell("%distribute_release", store_history=False)
        spark.stop()
        deadline = time.monotonic() + 15
        while (left := torchrun_pids()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return {"left": sorted(left), "session_starts": launcher.session_starts}


if __name__ == "__main__":
    main()
    RESULTS["done"] = True
    with open(OUT, "w") as handle:
        json.dump(RESULTS, handle, default=repr)
