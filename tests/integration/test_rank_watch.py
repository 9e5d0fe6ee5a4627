"""The Spark launcher's rank watch and the real watchdog process (``python -S -I``, no package) speak the
channel's `RankStarted` / `RankDone`: a worker that ends in Python is not reported dead, one whose watchdog
connection closes without `RankDone` is, and closing the watch kills the workers still running. No Spark:
a sleeping process stands for the worker."""

import subprocess
import sys
import time

import pytest

from dtrain_magic.launchers import watchdog
from dtrain_magic.launchers.spark.driver import _RankWatch

pytestmark = pytest.mark.slow


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def test_rank_watch_sees_done_deaths_and_kills_the_rest_on_close():
    watch = _RankWatch("127.0.0.1")
    host, port, authkey = watch.address
    workers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(3)]
    guards = [watchdog.start("rank-watch", host, str(port), str(rank), str(w.pid), secret=authkey)
              for rank, w in enumerate(workers)]
    try:
        assert wait_for(lambda: len(watch._listener._connections) == 3)
        guards[0].stdin.write(b"done\n")  # rank 0 ended in Python, then exits
        guards[0].stdin.flush()
        time.sleep(0.2)
        guards[0].stdin.close()
        guards[1].stdin.close()  # rank 1's worker died without saying done
        assert wait_for(lambda: 1 in watch.dead)
        assert guards[0].wait(5) == 0 and guards[1].wait(5) == 0
        time.sleep(0.2)
        assert set(watch.dead) == {1}
        assert workers[2].poll() is None
        watch.close()  # the run is over (or cancelled): the watchdog of the worker still running kills it
        assert workers[2].wait(5) == -9
        assert set(watch.dead) == {1}  # closing the watch is no death
    finally:
        watch.close()
        for proc in [*workers, *guards]:
            proc.kill()
            proc.wait(5)
