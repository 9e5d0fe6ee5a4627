"""The kernel's backend log (dtrain_magic/backend_log.py): a child started inside `fds_to_log` writes there, the
notebook's fds come back; a run's slice is what was written after its mark, capped, and what the cell shows of it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from dtrain_magic import backend_log


@pytest.fixture
def log_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(backend_log.LOG_DIR_ENV, str(tmp_path / "logs"))
    return tmp_path / "logs"


def _write(text: str) -> None:  # as a JVM started inside fds_to_log would
    backend_log.stream().write(text)


def test_path_is_per_process_in_a_private_directory(log_dir):
    assert backend_log.path() == str(log_dir / f"backend-{os.getpid()}.log")
    backend_log.logger("probe").info("one record")
    assert oct(os.stat(log_dir).st_mode & 0o777) == oct(0o700)
    assert oct(os.stat(backend_log.path()).st_mode & 0o777) == oct(0o600)


def test_a_process_started_inside_writes_to_the_log_for_its_life_and_the_fds_come_back(log_dir, capfd):
    child = "import sys, time; print('started'); sys.stdout.flush(); time.sleep(0.5); print('later', file=sys.stderr)"
    with backend_log.fds_to_log() as redirected:
        proc = subprocess.Popen([sys.executable, "-c", child])
    os.write(1, b"notebook line\n")  # fd 1 is the notebook's again while the child still runs
    proc.wait(30)
    assert redirected
    out, err = capfd.readouterr()
    assert "notebook line" in out and "started" not in out + err and "later" not in out + err
    assert open(backend_log.path()).read().split() == ["started", "later"]


def test_a_slice_is_what_came_after_the_mark(log_dir):
    assert backend_log.since(backend_log.mark()) == ""  # no log yet: nothing, no error
    _write("before the run\n")
    start = backend_log.mark()
    _write("Started local training with 2 processes\n")
    backend_log.logger("TorchDistributor").info("Finished local training with 2 processes")
    text = backend_log.since(start)
    assert "before the run" not in text
    assert text.startswith("Started local training") and text.rstrip().endswith("Finished local training with 2 "
                                                                                   "processes")


def test_a_big_slice_keeps_its_end_and_says_where_the_rest_is(log_dir):
    start = backend_log.mark()
    _write("".join(f"line {i}\n" for i in range(1000)))
    text = backend_log.since(start, limit=100)
    assert text.startswith("[") and backend_log.path() in text.splitlines()[0]
    assert text.endswith("line 999\n") and "line 0\n" not in text
    assert all(line.startswith("line ") for line in text.splitlines()[1:])  # whole lines only


def test_a_log_replaced_since_the_mark_is_read_from_its_start(log_dir):
    _write("x" * 100 + "\n")
    start = backend_log.mark()
    os.remove(backend_log.path())
    with open(backend_log.path(), "w") as file:  # (the stream still writes to the removed file)
        file.write("new log\n")
    assert backend_log.since(start) == "new log\n"


def test_the_cell_shows_the_last_lines_on_failure_all_with_verbose_nothing_otherwise(log_dir):
    start = backend_log.mark()
    assert backend_log.shown(start, failed=True, verbose=True) is None  # nothing written: nothing shown
    _write("".join(f"jvm {i}\n" for i in range(30)))
    assert backend_log.shown(start, failed=False, verbose=False) is None
    failed = backend_log.shown(start, failed=True, verbose=False, lines=5).splitlines()
    assert failed[1:] == [f"jvm {i}" for i in range(25, 30)] and backend_log.path() in failed[0]
    assert "--verbose" in failed[0]
    verbose = backend_log.shown(start, failed=False, verbose=True).splitlines()
    assert verbose[1:] == [f"jvm {i}" for i in range(30)]


def test_a_library_logger_goes_to_the_log_only_while_inside(log_dir, capsys):
    library = logging.getLogger("some_library_probe")
    handler = logging.StreamHandler(sys.stderr)
    library.addHandler(handler)
    try:
        with backend_log.logger_to_log("some_library_probe"):
            library.warning("Token authentication is enabled for this cluster")
            library.handlers.clear()  # as ray.init(configure_logging=False) does before it warns
            logging.getLogger("some_library_probe.auth").warning("still enabled")
        library.warning("after")
        assert library.handlers == [handler]  # restored
    finally:
        library.removeHandler(handler)
    err = capsys.readouterr().err
    assert "Token authentication" not in err and "still enabled" not in err and "after" in err
    logged = open(backend_log.path()).read()
    assert "Token authentication is enabled" in logged and "still enabled" in logged
    assert logging.lastResort is not None and logging.lastResort.stream is sys.stderr  # Python's own again


def test_a_directory_open_to_others_gets_no_log_and_the_output_stays_where_it_was(log_dir):
    log_dir.mkdir(mode=0o755)
    os.chmod(log_dir, 0o755)  # (mkdir's mode is masked by the umask)
    with backend_log.fds_to_log() as redirected:
        pass
    assert not redirected
    assert backend_log.stream() is sys.stdout
    assert not os.path.exists(backend_log.path())
