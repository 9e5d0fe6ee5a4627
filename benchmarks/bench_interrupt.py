"""Stop is instant (issue 25): the kernel's interrupt, many times per backend, through a real Jupyter kernel.

The suite interrupts 5 runs on local, 2 on Spark and 1 on Ray (each stopped run's next workers take 7-16 s to
come up: the suite's time). This runs the same cycle as the suite (``tests/integration/hang_cells.py``'s
`interrupt_cycles`: a long run with ``ctx.log`` every 10 ms, the kernel's interrupt once both ranks are in the
loop; the cell must be back within 2 s with ``RunInterrupted`` and every process of the run (worker, its
children, torchrun and its wrapper on Spark) gone 10 s after the interrupt) ``--count`` times per backend, each
backend in a kernel of its own, and reports the times and any failed cycle.

    .venv/bin/python benchmarks/bench_interrupt.py --count 5 --json benchmarks/results/interrupt.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from workload import write_json

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
sys.path[:0] = [os.path.join(TESTS, "integration"), TESTS]  # the suite's kernel harness and interrupt cycle
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # as tests/conftest.py sets for the suite


def cycles(backend: str, count: int) -> dict:
    """``count`` interrupt cycles on ``backend`` in a fresh kernel; a failed cycle ends the backend's series."""
    from hang_cells import interrupt_cycles, module_kernel

    kernel_life = module_kernel(tempfile.mkdtemp(prefix=f"bench_interrupt_{backend}_"))
    kernel = next(kernel_life)
    out: dict = {"count": count, "back_s": [], "start_s": [], "failure": None}
    began = time.monotonic()
    try:
        for _ in range(count):  # one cycle at a time: a failure still reports the cycles before it
            timings = interrupt_cycles(kernel, backend, 1)
            out["back_s"] += timings["back_s"]
            out["start_s"] += timings["start_s"]
    except AssertionError as exc:
        out["failure"] = f"cycle {len(out['back_s']) + 1}: {str(exc).splitlines()[0][:300]}"
    finally:
        try:
            kernel_life.close()  # shuts the kernel down; asserts that none of its processes is left 20 s later
        except AssertionError as exc:
            out["failure"] = (out["failure"] or "") + f"; at the kernel's shutdown: {exc}"
    out["seconds"] = time.monotonic() - began
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="local,spark,ray")
    parser.add_argument("--count", type=int, default=5, help="interrupts per backend (default 5)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.chdir(os.path.dirname(HERE))  # the kernels' PYTHONPATH starts with the project's root
    report: dict = {"count": args.count, "cpu_count": os.cpu_count(), "backends": {}}
    for backend in args.backends.split(","):
        result = cycles(backend, args.count)
        report["backends"][backend] = result
        backs = result["back_s"]
        summary = (f"cell back after the interrupt in {statistics.median(backs):.2f} s median, {max(backs):.2f} s "
                   f"at most (target < 2 s)" if backs else "no cycle finished")
        print(f"{backend}: {len(backs)} of {args.count} interrupts passed; {summary}; run start to both ranks in "
              f"the loop {statistics.median(result['start_s']) if backs else float('nan'):.1f} s median; "
              f"{'FAILED ' + result['failure'] if result['failure'] else 'nothing of any run left 10 s later'}",
              flush=True)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
