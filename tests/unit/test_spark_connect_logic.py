"""What the Spark launcher asks of a Spark Connect session, against fakes of its public surface (no JVM, no server):
`launchers/spark/sessions.py` and the Connect parts of `_compat/spark.py`. The real thing: tests/integration/
test_spark_connect.py."""

from __future__ import annotations

import types

import pytest

from dtrain_magic._compat import spark as spark_compat
from dtrain_magic.errors import ConfigError
from dtrain_magic.launchers.spark import SparkLauncher, sessions


class FakeConnectSession:
    """The public surface of ``pyspark.sql.connect.session.SparkSession`` the launcher uses."""

    def __init__(self, conf: dict, host: str = "localhost"):
        self.conf = types.SimpleNamespace(get=lambda key, default=None: conf.get(key, default))
        self.session_id = "abc"
        self.is_stopped = False
        self.calls: list[tuple] = []
        self.client = types.SimpleNamespace(_builder=types.SimpleNamespace(host=host))

    def addTag(self, tag):  # noqa: N802 - pyspark's names
        self.calls.append(("add", tag))

    def removeTag(self, tag):  # noqa: N802
        self.calls.append(("remove", tag))

    def interruptTag(self, tag):  # noqa: N802
        self.calls.append(("interrupt", tag))
        return []

    @property
    def sparkContext(self):  # noqa: N802 - as pyspark's Connect session: no JVM behind it
        raise AttributeError("[JVM_ATTRIBUTE_NOT_SUPPORTED] Attribute `sparkContext` is not supported in Spark Connect")


FakeConnectSession.__module__ = "pyspark.sql.connect.session"


@pytest.fixture(autouse=True)
def no_local_server(monkeypatch):
    monkeypatch.delenv("SPARK_LOCAL_REMOTE", raising=False)


def test_a_connect_session_is_read_through_what_connect_offers():
    spark = FakeConnectSession({"spark.master": "local[2]", "spark.task.cpus": "2"})
    assert sessions.is_connect(spark) and not sessions.is_connect(object())
    assert sessions.master(spark) == "local[2]" and sessions.identity(spark) == "connect:abc"
    assert sessions.alive(spark) and sessions.task_cpus(spark) == "2"
    assert sessions.task_slots(spark) == (0, 2)  # local[N]: N slots in the server's driver
    assert sessions.running_jobs(spark, "g") == []  # no status tracker: the operation's end says it
    spark.is_stopped = True
    assert not sessions.alive(spark)


@pytest.mark.parametrize("master", ["local[*]", "spark://10.0.0.5:7077", "yarn", ""])
def test_slots_behind_a_connect_server_are_not_guessed(master):
    assert sessions.task_slots(FakeConnectSession({"spark.master": master})) is None


def test_a_server_that_refuses_reading_its_settings_is_not_known():
    spark = FakeConnectSession({})

    def refuse(key, default=None):
        raise RuntimeError("[CONFIG_NOT_AVAILABLE] Configuration spark.master is not available.")

    spark.conf = types.SimpleNamespace(get=refuse)
    assert sessions.master(spark) == "" and sessions.task_slots(spark) is None and sessions.task_cpus(spark) == "1"
    assert not sessions.executors_here(spark)


def test_cancel_is_an_operation_tag_on_connect():
    spark = FakeConnectSession({})
    with spark_compat.job_group(spark, "dtrain_magic-1", "a run"):
        spark_compat.cancel_group(spark, "dtrain_magic-1")
    assert spark.calls == [("add", "dtrain_magic-1"), ("interrupt", "dtrain_magic-1"), ("remove", "dtrain_magic-1")]


def test_where_a_connect_servers_executors_run(monkeypatch):
    remote = FakeConnectSession({"spark.master": "local[4]"}, host="connect.example.com")
    assert not sessions.executors_here(remote) and not sessions.writer_here(remote)  # --data needs --data-dir
    here = FakeConnectSession({"spark.master": "local[4]"}, host="localhost")
    assert sessions.executors_here(here) and sessions.writer_here(here)
    cluster_here = FakeConnectSession({"spark.master": "spark://10.0.0.5:7077"}, host="127.0.0.1")
    assert not sessions.executors_here(cluster_here) and sessions.writer_here(cluster_here)
    monkeypatch.setenv("SPARK_LOCAL_REMOTE", "1")  # pyspark started the server in this process
    assert spark_compat.connect_server_here(remote)


def test_cluster_on_a_local_server_without_the_notebooks_python_is_refused(monkeypatch):
    spark = FakeConnectSession({"spark.master": "local[2]"})
    monkeypatch.setattr(spark_compat, "connect_server_python", lambda: None)
    with pytest.raises(ConfigError, match=r"^--cluster: .*PYSPARK_PYTHON.*nothing was launched$"):
        sessions.check_connect_cluster_python(spark)
    for known in ("/venv/bin/python", spark_compat.UNKNOWN):  # set, or not ours to tell: let it run
        monkeypatch.setattr(spark_compat, "connect_server_python", lambda known=known: known)
        sessions.check_connect_cluster_python(spark)


def test_the_servers_python_is_unknown_without_a_local_server():
    assert spark_compat.connect_server_python() is spark_compat.UNKNOWN


def test_auto_sees_a_connect_session():
    classic = types.SimpleNamespace(SparkSession=types.SimpleNamespace(getActiveSession=lambda: None))
    connect = types.SimpleNamespace(SparkSession=types.SimpleNamespace(getActiveSession=lambda: object()))
    assert SparkLauncher.in_use({"pyspark.sql": classic, "pyspark.sql.connect.session": connect})
    assert not SparkLauncher.in_use({"pyspark.sql": classic})
