"""Finding processes a notebook left behind, whoever started them (local workers, torchrun, JVMs, Ray).

A test gives the notebook process a unique environment entry; every process it starts, directly or
through a backend (the fork server's workers, TorchDistributor's torchrun, Spark's JVM and executors,
Ray's GCS, raylet, agents and workers), inherits it. Command lines are no use for this: Ray rewrites its
processes' titles, and forked workers carry their server's command line.
"""

from __future__ import annotations

import os
import time
import uuid

TAG_KEY = "DTRAIN_TEST_NOTEBOOK"


def new_tag() -> str:
    return uuid.uuid4().hex


def tagged_env(tag: str, **extra: str) -> dict[str, str]:
    return {**os.environ, TAG_KEY: tag, **extra}


def tagged_processes(tag: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live, non-zombie process started with the tag in its environment."""
    wanted = f"{TAG_KEY}={tag}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as handle:
                if wanted not in handle.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/stat") as handle:
                if handle.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as handle:
                command = handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError):
            continue
        found.append((int(name), command[:160]))
    return found


def wait_until_none_left(tag: str, within_s: float) -> list[tuple[int, str]]:
    """Poll until no tagged process is alive or ``within_s`` passed; what is still alive then."""
    deadline = time.monotonic() + within_s
    left = tagged_processes(tag)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = tagged_processes(tag)
    return left


def kill_tagged(tag: str) -> None:
    """Clean up after a failed assertion, so one test's leftovers do not burden the next ones."""
    import signal

    for pid, _ in tagged_processes(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
