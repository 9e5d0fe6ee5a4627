"""Pure diagnostics for the Spark backend (unit-tested without Spark): the Java check, master URLs, and
turning TorchDistributor/torchrun/Spark failures into one line that says what happened."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from ...errors import MissingDependencyError, summary
from ..base import describe_exit

MIN_JAVA = 17  # pyspark 4 runs on Java 17 and 21


def parse_java_version(text: str) -> int | None:
    """Major Java version from ``java -version`` output (``1.8.0_392`` → 8, ``17.0.9`` → 17)."""
    match = re.search(r'version "(\d+)(?:\.(\d+))?', text)
    if not match:
        match = re.search(r"^\S+ (\d+)(?:\.(\d+))?", text.strip())  # e.g. 'openjdk 21.0.1 2023-10-17'
        if not match:
            return None
    major = int(match.group(1))
    if major == 1 and match.group(2):
        return int(match.group(2))
    return major


def java_command(environ: dict[str, str] | None = None) -> str | None:
    """The java Spark will use: ``$JAVA_HOME/bin/java`` when JAVA_HOME is set, else ``java`` on PATH."""
    environ = os.environ if environ is None else environ
    home = environ.get("JAVA_HOME")
    if home:
        candidate = os.path.join(home, "bin", "java")
        return candidate if os.path.exists(candidate) else None
    return shutil.which("java", path=environ.get("PATH"))


def check_java(environ: dict[str, str] | None = None, minimum: int = MIN_JAVA) -> int:
    """Raise `MissingDependencyError` unless a Java >= ``minimum`` is there; returns its major version."""
    environ = os.environ if environ is None else environ
    java = java_command(environ)
    where = f"JAVA_HOME={environ['JAVA_HOME']}" if environ.get("JAVA_HOME") else "PATH"
    if java is None:
        raise MissingDependencyError(
            f"--backend spark needs Java {minimum} or newer (pyspark runs on the JVM) and no java was found "
            f"on {where}. Install a JDK {minimum}+ (e.g. `apt-get install openjdk-17-jre-headless`) and set "
            "JAVA_HOME; nothing was launched"
        )
    try:
        proc = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
        text = (proc.stderr or "") + (proc.stdout or "")
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MissingDependencyError(
            f"--backend spark: could not run `{java} -version`: {exc}; nothing was launched"
        ) from None
    major = parse_java_version(text)
    if major is None:
        raise MissingDependencyError(
            f"--backend spark: could not read the Java version from `{java} -version` "
            f"({text.strip().splitlines()[0] if text.strip() else 'no output'}); nothing was launched"
        )
    if major < minimum:
        raise MissingDependencyError(
            f"--backend spark needs Java {minimum} or newer for pyspark 4, but {java} (from {where}) is Java "
            f"{major}. Install a JDK {minimum}+ and point JAVA_HOME at it; nothing was launched"
        )
    return major


def is_loopback_master(master: str | None) -> bool:
    """``local``, ``local[*]``, ``local-cluster[...]`` or a master URL on this machine's loopback."""
    if not master:
        return True
    if master == "local" or master.startswith(("local[", "local-cluster[")):
        return True
    host = re.sub(r"^[a-z0-9+]+://", "", master).split("/")[0].rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1")


def gpu_setting_error(message: str, local_mode: bool) -> str | None:
    """TorchDistributor's GPU RuntimeError → what to change (None when it is not a GPU setting problem)."""
    if "spark.task.resource.gpu.amount" in message:
        return (
            f"TorchDistributor refused --gpu --cluster: {message.strip()} Set the Spark config "
            "spark.task.resource.gpu.amount=1 (and spark.executor.resource.gpu.amount, plus a GPU discovery "
            "script, on the executors) on the cluster, or run with --cpu"
        )
    if "must be a multiple of" in message:
        return f"TorchDistributor refused --gpu: {message.strip()} Change -n or spark.task.resource.gpu.amount"
    if "GPU" in message and ("driver" in message or "configured" in message):
        return (
            f"TorchDistributor refused --gpu --local-mode: {message.strip()} Set the Spark config "
            "spark.driver.resource.gpu.amount=<GPUs on the driver> (with "
            "spark.driver.resource.gpu.discoveryScript) when the session starts, or run with --cpu"
        )
    return None


_ERROR_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)\b:?.*)$")


def torchrun_root_cause(text: str) -> tuple[int, str] | None:
    """(rank, what happened) from torchrun's ChildFailedError report ("Root Cause" section), if present."""
    section = text.split("Root Cause", 1)[1] if "Root Cause" in text else ""
    rank = re.search(r"rank\s*:\s*(\d+)", section)
    code = re.search(r"exitcode\s*:\s*(-?\d+)", section)
    if not (rank and code):
        return None
    return int(rank.group(1)), describe_exit(int(code.group(1)))


def one_line_reason(exc: BaseException) -> str:
    """A one-line account of a TorchDistributor/Spark exception that no worker reported itself."""
    text = str(exc)
    code = re.search(r"failed with return code (-?\d+)", text)
    errors = [m.group(1).strip() for line in text.splitlines() if (m := _ERROR_LINE.match(line))]
    wrappers = ("py4j.", "RuntimeError: Command", "org.apache.spark.SparkException: Job aborted")
    errors = [e for e in errors if not e.startswith(wrappers)]
    if code:
        reason = f"torchrun exited with code {code.group(1)}"
        return f"{reason}: {errors[-1][:300]}" if errors else reason
    if "cancelled" in text.lower() and "job" in text.lower():
        return "the Spark job was cancelled"
    if errors:
        return errors[-1][:300]
    return summary(exc, limit=300)
