"""Pure logic of the Spark launcher: Java checks, master URLs, error translation (no JVM started)."""

import os
import stat

import pytest

from dtrain_magic.config import RunConfig
from dtrain_magic.errors import MissingDependencyError
from dtrain_magic.launchers import spark
from interpreters import bare_python


@pytest.mark.parametrize(
    "text, major",
    [
        ('openjdk version "17.0.9" 2023-10-17\nOpenJDK Runtime Environment', 17),
        ('java version "1.8.0_392"\nJava(TM) SE Runtime Environment', 8),
        ('openjdk version "21" 2023-09-19', 21),
        ('openjdk version "11.0.21" 2023-10-17 LTS', 11),
        ("openjdk 21.0.1 2023-10-17", 21),
        ("something else", None),
    ],
)
def test_parse_java_version(text, major):
    assert spark.parse_java_version(text) == major


def _fake_java(tmp_path, output: str) -> str:
    home = tmp_path / "jdk"
    (home / "bin").mkdir(parents=True)
    java = home / "bin" / "java"
    java.write_text(f"#!/bin/sh\ncat >&2 <<'EOF'\n{output}\nEOF\n")
    java.chmod(java.stat().st_mode | stat.S_IEXEC)
    return str(home)


def test_java_too_old_is_a_clear_error_naming_java_home(tmp_path):
    home = _fake_java(tmp_path, 'java version "1.8.0_392"')
    with pytest.raises(MissingDependencyError) as info:
        spark.check_java({"JAVA_HOME": home, "PATH": os.environ.get("PATH", "")})
    message = str(info.value)
    assert "Java 17 or newer" in message and "Java 8" in message and "JAVA_HOME" in message
    assert "nothing was launched" in message


def test_java_missing_is_a_clear_error(tmp_path):
    with pytest.raises(MissingDependencyError, match="no java was found"):
        spark.check_java({"PATH": str(tmp_path)})
    with pytest.raises(MissingDependencyError, match="no java was found on JAVA_HOME"):
        spark.check_java({"JAVA_HOME": str(tmp_path / "nope"), "PATH": ""})


def test_java_17_is_accepted(tmp_path):
    home = _fake_java(tmp_path, 'openjdk version "17.0.9" 2023-10-17')
    assert spark.check_java({"JAVA_HOME": home, "PATH": ""}) == 17


@pytest.mark.parametrize(
    "master, loopback",
    [
        (None, True), ("local", True), ("local[*]", True), ("local[2]", True), ("local-cluster[2,1,1024]", True),
        ("spark://127.0.0.1:7077", True), ("spark://localhost:7077", True), ("spark://10.0.0.5:7077", False),
        ("yarn", False), ("k8s://https://api.example.com:6443", False), ("sc://databricks.example.com", False),
    ],
)
def test_loopback_masters(master, loopback):
    assert spark.is_loopback_master(master) is loopback


def test_gpu_errors_name_the_spark_setting():
    text = spark.gpu_setting_error("'spark.task.resource.gpu.amount' was unset, so gpu usage is unavailable.", False)
    assert "spark.task.resource.gpu.amount=1" in text and "--cpu" in text
    text = spark.gpu_setting_error("GPUs were unable to be found on the driver.", True)
    assert "spark.driver.resource.gpu.amount" in text
    assert spark.gpu_setting_error("something unrelated", True) is None


def test_one_line_reason_of_a_torchrun_failure():
    exc = RuntimeError(
        "Command ['python', '-m', 'pyspark.ml.torch.torch_run_process_wrapper', '--standalone'] failed with "
        "return code 1. The task output is included below: Traceback (most recent call last):\n"
        '  File "train.py", line 3, in <module>\nModuleNotFoundError: No module named \'dtrain_magic\'\n'
    )
    reason = spark.one_line_reason(exc)
    assert reason == "torchrun exited with code 1: ModuleNotFoundError: No module named 'dtrain_magic'"
    assert "\n" not in spark.one_line_reason(RuntimeError("first line\nsecond line"))


def test_channel_host_is_loopback_in_local_mode_and_for_loopback_masters():
    launcher = spark.SparkLauncher()
    assert launcher.channel_host(RunConfig(backend="spark")) == "127.0.0.1"
    config = RunConfig(backend="spark", local_mode=False, spark_master="local-cluster[2,1,1024]")
    launcher._active_session = lambda: None  # no pyspark session in this unit test
    assert launcher.channel_host(config) == "127.0.0.1"


def test_describe_names_the_torchdistributor_parameters():
    launcher = spark.SparkLauncher()
    launcher._active_session = lambda: None
    text = launcher.describe(RunConfig(backend="spark", num_processes=4, local_mode=False))
    assert "TorchDistributor(num_processes=4, local_mode=False, use_gpu=False)" in text
    assert "barrier tasks" in text


CHILD_FAILED = """Command [...] failed with return code 1. The task output is included below:
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_14:00:00
  host      : box
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
============================================================
"""


def test_torchrun_root_cause_names_the_rank_and_the_signal():
    assert spark.torchrun_root_cause(CHILD_FAILED) == (1, "process was killed by SIGKILL")
    assert spark.torchrun_root_cause(CHILD_FAILED.replace("-9 (pid", "2 (pid")) == (1, "process exited with code 2")
    assert spark.torchrun_root_cause("no report here") is None


# -- --cluster on a classic session: its Python workers' interpreter must import dtrain_magic ------------------------

class _Context:
    """What `check_cluster_python` reads of a classic SparkContext: its master and its workers' Python."""

    def __init__(self, master: str, python: str):
        self.master, self.pythonExec = master, python


class _ClassicSession:
    def __init__(self, master: str, python: str):
        self.sparkContext = _Context(master, python)


def test_cluster_on_a_local_session_whose_python_lacks_dtrain_magic_is_refused_with_the_fix(tmp_path, monkeypatch):
    """A notebook that built ``SparkSession.builder.master("local[2]")`` without PYSPARK_PYTHON: its workers run
    ``python3``, which here lacks dtrain_magic (a real interpreter is asked, from a directory without a checkout):
    refused before launch, naming the flag, the interpreter and the fix. The notebook's own interpreter passes, and a
    remote master's workers are not looked into."""
    import sys

    from dtrain_magic.errors import ConfigError
    from dtrain_magic.launchers.spark import sessions

    monkeypatch.chdir(tmp_path)
    bare = bare_python(tmp_path)  # an interpreter without dtrain_magic on its path, whatever the machine has
    refused = r"^--cluster: .*run `.*bare-python`.*PYSPARK_PYTHON.*nothing was launched$"
    for master in ("local[2]", "local-cluster[2,1,1024]"):
        with pytest.raises(ConfigError, match=refused):
            sessions.check_cluster_python(_ClassicSession(master, str(bare)))
    sessions.check_cluster_python(_ClassicSession("local[2]", sys.executable))
    sessions.check_cluster_python(_ClassicSession("spark://10.0.0.5:7077", str(bare)))  # not on this machine
