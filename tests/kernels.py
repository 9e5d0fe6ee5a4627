"""A real Jupyter kernel for tests: cells on its main shell or on a subshell (ipykernel >= 7, JEP 91), the
kernel's interrupt as Jupyter sends it (SIGINT), and what each cell printed and raised.

One thread reads every IOPub message and files it under the request it answers, so a cell on a subshell can run
while the main shell is busy with another (``%distribute_stacks`` on a live run). Every process the kernel
starts carries the test's tag (tests/leftovers.py).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from leftovers import tagged_env


@dataclass
class CellRun:
    """One cell's request: ``done`` is set when the kernel went idle for it."""

    msg_id: str
    sent_at: float
    stream: list[str] = field(default_factory=list)
    error: tuple[str, str] | None = None  # (ename, evalue)
    traceback: str = ""
    result: str | None = None
    done: threading.Event = field(default_factory=threading.Event)
    done_at: float | None = None

    @property
    def text(self) -> str:
        return "".join(self.stream)

    def wait(self, timeout: float) -> "CellRun":
        if not self.done.wait(timeout):
            raise AssertionError(f"the cell did not finish within {timeout:g} s; output so far:\n{self.text[-3000:]}")
        return self


class Kernel:
    """``Kernel(tag, cwd, env)``: start it; `run` a cell (`submit` without waiting), `interrupt`, `shutdown`."""

    def __init__(self, tag: str, cwd: str, **env: str):
        from jupyter_client import KernelManager

        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=tagged_env(tag, **env), cwd=cwd)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        self._runs: dict[str, CellRun] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, name="test-iopub", daemon=True)
        self._reader.start()
        self.subshell: str | None = None

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self.kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                continue
            except Exception:
                return
            parent = msg.get("parent_header", {}).get("msg_id")
            with self._lock:
                run = self._runs.get(parent)
            if run is None:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                run.stream.append(content["text"])
            elif kind == "error":
                run.error = (content["ename"], content["evalue"])
                run.traceback = "\n".join(content.get("traceback", []))
            elif kind == "execute_result":
                run.result = content["data"].get("text/plain")
            elif kind == "status" and content["execution_state"] == "idle":
                run.done_at = time.monotonic()
                run.done.set()

    def submit(self, code: str, subshell: bool = False) -> CellRun:
        """Send a cell (on the subshell with ``subshell``) and return at once."""
        msg = self.kc.session.msg("execute_request", {"code": code, "silent": False, "store_history": True,
                                                      "user_expressions": {}, "allow_stdin": False,
                                                      "stop_on_error": False})
        if subshell:
            msg["header"]["subshell_id"] = self._subshell_id()
        run = CellRun(msg["header"]["msg_id"], time.monotonic())
        with self._lock:
            self._runs[run.msg_id] = run
        self.kc.shell_channel.send(msg)
        return run

    def run(self, code: str, timeout: float = 300, subshell: bool = False) -> CellRun:
        return self.submit(code, subshell).wait(timeout)

    def _subshell_id(self) -> str:
        if self.subshell is None:
            msg = self.kc.session.msg("create_subshell_request", {})
            self.kc.control_channel.send(msg)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                reply = self.kc.get_control_msg(timeout=30)
                if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                    self.subshell = reply["content"]["subshell_id"]
                    break
            assert self.subshell, "the kernel made no subshell"
        return self.subshell

    def interrupt(self) -> float:
        """The kernel's interrupt, as Jupyter sends it; when it was sent."""
        sent = time.monotonic()
        self.km.interrupt_kernel()
        return sent

    def pid(self) -> int:
        return self.km.provisioner.process.pid

    def shutdown(self) -> None:
        self._stop.set()
        try:
            self.kc.stop_channels()
        finally:
            self.km.shutdown_kernel(now=False)
