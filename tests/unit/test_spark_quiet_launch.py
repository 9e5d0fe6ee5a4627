"""What a TorchDistributor launch of ours prints goes to the backend log, not the cell (`_compat.spark.quiet_launches`,
`route_distributor_log`): pyspark's ``sys.stdout`` writes from the launch's thread only, and torchrun's
``OMP_NUM_THREADS`` set for it unless the notebook sets it."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import threading

import pytest

from dtrain_magic._compat import spark as spark_compat

distributor = pytest.importorskip("pyspark.ml.torch.distributor")


def test_the_launch_threads_output_goes_to_the_log_and_other_threads_print_as_before():
    log = io.StringIO()
    seen: dict[str, object] = {}
    with spark_compat.quiet_launches(log, {}) as quiet:
        distributor.sys.stdout.write("*** Setting OMP_NUM_THREADS ***\n")  # as _execute_command writes torchrun's
        other = threading.Thread(target=lambda: seen.update(stdout=distributor.sys.stdout))
        other.start()
        other.join()
    assert quiet and log.getvalue() == "*** Setting OMP_NUM_THREADS ***\n"
    assert seen["stdout"] is sys.stdout and distributor.sys.stdout is sys.stdout  # another thread; after it
    assert distributor.sys.executable == sys.executable  # the rest of sys as it is


@pytest.mark.parametrize("notebook_sets, expected", [(None, "1"), ("3", "3")])
def test_torchrun_gets_omp_num_threads_unless_the_notebook_sets_it(monkeypatch, notebook_sets, expected):
    if notebook_sets is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", notebook_sets)
    with spark_compat.quiet_launches(io.StringIO(), {"OMP_NUM_THREADS": "1"}):
        proc = distributor.subprocess.Popen(  # as _execute_command starts torchrun's wrapper
            [sys.executable, "-c", "import os; print(os.environ.get('OMP_NUM_THREADS'))"],
            stdout=subprocess.PIPE, env=os.environ)
    assert proc.communicate(timeout=30)[0].decode().strip() == expected


def test_a_distributors_log_lines_go_to_the_given_logger(caplog):
    class Distributor:  # pyspark's TorchDistributor keeps its logger on the instance
        logger = logging.getLogger("TorchDistributor")

    ours = logging.getLogger("test.backend.TorchDistributor")
    one = Distributor()
    spark_compat.route_distributor_log(one, ours)
    with caplog.at_level(logging.INFO):
        one.logger.info("Started local training with 2 processes")
    assert [(r.name, r.getMessage()) for r in caplog.records] == [("test.backend.TorchDistributor",
                                                                    "Started local training with 2 processes")]
    assert Distributor.logger.name == "TorchDistributor"  # another instance (the user's own) keeps pyspark's
