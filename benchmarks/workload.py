"""The fixed small job every benchmark runs, and what the benchmarks share to time it.

The job: an MLP (32 → 64 → 1), Adam, ``steps`` steps of 32 random samples per rank, DDP over gloo
(nccl with ``gpu=True``). ``raw_train`` is the plain torch.distributed version (what a torchrun script,
``TorchDistributor.run`` or ``TorchTrainer.fit`` runs); ``MAGIC_BODY`` is the same loop written against
``ctx`` for ``%%distribute``. Both return rank's wall-clock (``time.time()``) marks:

* ``proc_start``: when this worker process started (a warm-pool process starts before the call);
* ``entered``: the function's first line (raw: before ``import torch``; magic: the process group is
  joined by then);
* ``joined`` (raw only): process group joined (``import torch`` + ``init_process_group`` done);
* ``prepared``: model built and wrapped (DDP / ``ctx.prepare``);
* ``first_step``: first optimizer step done;

and the steady-state steps per second (after ``WARMUP_STEPS`` steps). So time to first step, and its
parts, are measured the same way on both sides.

`Probes` times the magic's notebook-side steps (MLflow, system metrics, launch) by wrapping a few
dtrain_magic functions in the benchmark's own process: nothing in dtrain_magic changes.
"""

from __future__ import annotations

import json
import os
import statistics
import time

WARMUP_STEPS = 10


def process_start_time() -> float | None:
    """This process's start as a ``time.time()`` value (10 ms resolution; Linux only, else None)."""
    try:
        with open("/proc/self/stat") as handle:
            ticks = int(handle.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, in clock ticks
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def raw_train(steps: int = 200, gpu: bool = False, device=None, threads: int | None = None) -> dict:
    entered = time.time()
    import torch
    import torch.distributed as dist

    if threads:
        torch.set_num_threads(threads)  # as OMP_NUM_THREADS=threads would (torchrun sets 1 for several workers)

    owns = not dist.is_initialized()  # Ray Train joins the process group before calling the loop
    if owns:
        dist.init_process_group("nccl" if gpu else "gloo")
    joined = time.time()
    try:
        if device is None:
            if gpu:
                device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
                torch.cuda.set_device(device)
            else:
                device = torch.device("cpu")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
        if dist.get_world_size() > 1:
            ids = [device.index] if device.type == "cuda" else None
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        prepared = time.time()
        g = torch.Generator().manual_seed(dist.get_rank())
        first = steady_from = None
        for step in range(steps):
            x = torch.randn(32, 32, generator=g).to(device)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            value = loss.item()  # the magic's loop reads the loss for ctx.log; so does this one
            if first is None:
                first = time.time()
            if step == WARMUP_STEPS - 1:
                steady_from = time.perf_counter()
        rate = (steps - WARMUP_STEPS) / (time.perf_counter() - steady_from)
        return {"first_step": first, "steps_per_s": rate, "loss": value, "entered": entered, "joined": joined,
                "prepared": prepared, "proc_start": process_start_time(), "rank": dist.get_rank()}
    finally:
        if owns:
            dist.destroy_process_group()


# The same loop through ctx. STEPS and LOG come from the notebook's namespace (shipped by value).
MAGIC_BODY = '''
import os
import time
import torch
def train(ctx):
    entered = time.time()
    try:  # when this worker process started (a warm-pool process starts before the call)
        with open("/proc/self/stat") as handle:
            ticks = int(handle.read().rsplit(")", 1)[1].split()[19])
        proc_start = time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except Exception:
        proc_start = None
    steps, log = STEPS, LOG
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = ctx.prepare(model, opt)
    prepared = time.time()
    g = torch.Generator().manual_seed(ctx.rank)
    first = steady_from = None
    for step in range(steps):
        x = torch.randn(32, 32, generator=g).to(ctx.device)
        loss = model(x).pow(2).mean()
        ctx.backward(loss)
        ctx.step()
        value = loss.item()
        if log:
            ctx.log(loss=value)
        if first is None:
            first = time.time()
        if step == 9:
            steady_from = time.perf_counter()
    rate = (steps - 10) / (time.perf_counter() - steady_from)
    return {"first_step": first, "steps_per_s": rate, "loss": value, "entered": entered, "prepared": prepared,
            "proc_start": proc_start, "rank": ctx.rank}
'''


def summarize(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"min": None, "median": None, "max": None, "n": 0}
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def now() -> float:
    return time.time()


# -- parts of the time to first step ------------------------------------------------------------------

PART_LABELS = {
    "spark_session": "SparkSession start (JVM)",
    "check_capture": "flags, backend check, cell capture",
    "mlflow_import": "MLflow: import (background thread; overlaps the parts above and below)",
    "mlflow_run": "MLflow: run creation (experiment, run, params; background thread)",
    "schema_migration": "  of which: new tracking DB's schema migration",
    "system_metrics": "MLflow: system-metrics monitor start (background thread)",
    "mlflow_after_launch": "MLflow run ready after the launch by (off the critical path)",
    "notebook_other": "notebook side up to the launch "
                      "(warm-up, channel; waiting for the MLflow run if the backend needs its id)",
    "launch_call": "launcher.start() call",
    "worker_start": "launch → worker function entry (processes, interpreter, imports, process group)",
    "backend_launch": "backend launch → worker function entry",
    "imports_join": "worker: import torch + process group join",
    "prepare": "model + DDP wrap (ctx.prepare)",
    "first_step": "first optimizer step",
}
# Parts that are not summed into the total: MLflow opens in a background thread, beside the other parts.
SUB_PARTS = {"schema_migration", "mlflow_import", "mlflow_run", "system_metrics", "mlflow_after_launch"}


def magic_parts(call: float, marks: dict, worker: dict, session_s: float | None = None) -> dict:
    """Time to first step of one magic call, split into its parts (seconds; they sum to the total)."""
    parts: dict[str, float] = {}
    execute_in = marks.get("execute_in")
    launch_in, launch_out = marks.get("launch_in"), marks.get("launch_out")
    if execute_in is None or launch_in is None or launch_out is None:
        return {"first_step_total": worker["first_step"] - call}
    before = execute_in - call
    if session_s:
        parts["spark_session"] = session_s
        before -= session_s
    parts["check_capture"] = before
    if "tracker_in" in marks and "tracker_out" in marks:
        parts["mlflow_import"] = marks["mlflow_imported"] - marks["tracker_in"]
        parts["mlflow_run"] = marks["tracker_out"] - marks["mlflow_imported"]
        parts["schema_migration"] = marks.get("migration_s", 0.0)
        parts["mlflow_after_launch"] = max(0.0, marks["tracker_out"] - launch_out)
    if "sysmetrics_in" in marks and "sysmetrics_out" in marks:
        parts["system_metrics"] = marks["sysmetrics_out"] - marks["sysmetrics_in"]
    parts["notebook_other"] = launch_in - execute_in
    parts["launch_call"] = launch_out - launch_in
    parts["worker_start"] = worker["entered"] - launch_out
    parts["prepare"] = worker["prepared"] - worker["entered"]
    parts["first_step"] = worker["first_step"] - worker["prepared"]
    if worker.get("proc_start") is not None:
        parts["proc_start_vs_call"] = worker["proc_start"] - call  # negative: a pool process, started earlier
    return parts


def raw_parts(call: float, worker: dict, session_s: float | None = None) -> dict:
    """Time to first step of one raw call, split into its parts."""
    parts: dict[str, float] = {}
    launch = worker["entered"] - call
    if session_s:
        parts["spark_session"] = session_s
        launch -= session_s
    parts["backend_launch"] = launch
    parts["imports_join"] = worker["joined"] - worker["entered"]
    parts["prepare"] = worker["prepared"] - worker["joined"]
    parts["first_step"] = worker["first_step"] - worker["prepared"]
    if worker.get("proc_start") is not None:
        parts["proc_start_vs_call"] = worker["proc_start"] - call
    return parts


def median_parts(samples: list[dict]) -> dict:
    """Per-part medians over samples that have the part."""
    keys: list[str] = []
    for sample in samples:
        keys += [k for k in sample.get("parts", {}) if k not in keys]
    return {k: statistics.median(s["parts"][k] for s in samples if k in s.get("parts", {})) for k in keys}


def format_parts(parts: dict) -> list[str]:
    lines = []
    for key, value in parts.items():
        if key == "proc_start_vs_call":
            where = "before" if value < 0 else "after"
            lines.append(f"    (worker process started {abs(value):.2f} s {where} the call)")
        elif key in PART_LABELS:
            lines.append(f"    {PART_LABELS[key]:<82} {value:6.2f} s")
    return lines


class Probes:
    """Wall-clock marks of one magic call's notebook-side steps, by wrapping dtrain_magic functions in
    this (the benchmark's) process. A function that moved or was renamed is simply not timed."""

    def __init__(self, backend: str):
        self.marks: dict[str, float] = {}
        from dtrain_magic import tracking
        from dtrain_magic.driver import runner
        from dtrain_magic.launchers import get_launcher

        marks = self.marks
        execute = runner.PreparedRun.execute

        def timed_execute(*args, **kwargs):
            marks["execute_in"] = time.time()
            return execute(*args, **kwargs)

        runner.PreparedRun.execute = timed_execute
        tracker_cls = getattr(tracking, "RunTracker", None)
        if tracker_cls is not None and hasattr(tracker_cls, "start"):
            start = tracker_cls.start  # bound classmethod

            def timed_start(cls, *args, **kwargs):
                marks["tracker_in"] = time.time()
                getattr(tracking, "wait_for_preload", lambda: None)()  # never import beside its preload thread
                import mlflow  # noqa: F401  (timed alone: the first call in a fresh kernel pays it)

                self._wrap_migration()
                marks["mlflow_imported"] = time.time()
                try:
                    return start(*args, **kwargs)
                finally:
                    marks["tracker_out"] = time.time()

            tracker_cls.start = classmethod(timed_start)
        if tracker_cls is not None and hasattr(tracker_cls, "start_system_metrics"):
            system_metrics = tracker_cls.start_system_metrics

            def timed_system_metrics(tracker, *args, **kwargs):
                marks["sysmetrics_in"] = time.time()
                try:
                    return system_metrics(tracker, *args, **kwargs)
                finally:
                    marks["sysmetrics_out"] = time.time()

            tracker_cls.start_system_metrics = timed_system_metrics
        launcher = get_launcher(backend)
        launch = launcher.start

        def timed_launch(*args, **kwargs):
            marks["launch_in"] = time.time()
            try:
                return launch(*args, **kwargs)
            finally:
                marks["launch_out"] = time.time()

        launcher.start = timed_launch

    def _wrap_migration(self) -> None:
        try:
            import mlflow.store.db.utils as db_utils
        except ImportError:
            return
        if getattr(db_utils._initialize_tables, "_timed", False):
            return
        initialize = db_utils._initialize_tables
        marks = self.marks

        def timed_initialize(*args, **kwargs):
            t0 = time.time()
            try:
                return initialize(*args, **kwargs)
            finally:
                marks["migration_s"] = marks.get("migration_s", 0.0) + time.time() - t0

        timed_initialize._timed = True
        db_utils._initialize_tables = timed_initialize

    def reset(self) -> dict:
        marks = dict(self.marks)
        self.marks.clear()
        return marks


def create_tracking_db(uri: str) -> float:
    """Create the MLflow tracking DB at ``uri`` now (untimed by the runs); seconds its creation took.

    Cold samples then measure a fresh kernel with an existing DB (the usual case); the one-off cost of
    a new DB (schema migration) is this number."""
    import logging

    for name in ("alembic", "mlflow.store.db.utils", "mlflow.tracking"):
        logging.getLogger(name).setLevel(logging.WARNING)
    from mlflow import MlflowClient

    t0 = time.perf_counter()
    MlflowClient(tracking_uri=uri).search_experiments()
    return time.perf_counter() - t0


def settle(max_s: float = 8.0, idle_cpu: float = 0.15, window_s: float = 0.25) -> float:
    """Wait until this process and its Python descendants are idle (a warm pool refilling, workers
    tearing down), so no call pays for the previous one's background work; seconds waited. Replaces a fixed
    pause between calls: returns as soon as two windows in a row use under ``idle_cpu`` of a core."""
    try:
        import psutil
    except ImportError:
        time.sleep(min(max_s, 3.0))
        return min(max_s, 3.0)
    me = psutil.Process()

    def cpu() -> dict[int, float]:
        seen = {}
        for proc in [me, *me.children(recursive=True)]:
            try:
                if proc is not me and not proc.name().startswith("python"):
                    continue  # a JVM's or Ray's own background work is not a previous run's leftover
                times = proc.cpu_times()
                seen[proc.pid] = times.user + times.system
            except psutil.Error:
                pass
        return seen

    started = time.monotonic()
    quiet = 0
    before = cpu()
    while time.monotonic() - started < max_s:
        time.sleep(window_s)
        after = cpu()
        used = sum(max(0.0, t - before.get(pid, 0.0)) for pid, t in after.items())
        before = after
        quiet = quiet + 1 if used < idle_cpu * window_s else 0
        if quiet >= 2:
            break
    return time.monotonic() - started


def driver_cpu() -> float:
    """CPU seconds this process (the notebook, or the raw launcher's parent) has used so far, not its children."""
    times = os.times()
    return times.user + times.system


# -- comparison tables shared by bench_local, bench_spark and bench_ray ---------------------------------

def section(data: dict[str, list[dict]]) -> dict:
    """min/median/max of every number of each side's samples, per-part medians, and the magic/raw ratios."""
    out: dict = {}
    for via, samples in data.items():
        if not samples:
            continue
        keys = [k for k in ("ttfs", "total", "steps_per_s", "driver_cpu_s") if any(k in s for s in samples)]
        out[via] = {k: summarize([s.get(k) for s in samples]) for k in keys}
        out[via]["parts"] = median_parts(samples)
    if "magic" in out and "raw" in out:
        out["ttfs_ratio"] = out["magic"]["ttfs"]["median"] / out["raw"]["ttfs"]["median"]
        out["total_ratio"] = out["magic"]["total"]["median"] / out["raw"]["total"]["median"]
    return out


def finish_report(report: dict, samples: dict[str, dict], began: float, load_start: float) -> None:
    """Add the cold/warm sections and ratios, the backend's own launch, duration and load to ``report``."""
    for name, data in samples.items():
        report[name] = section(data)
        if "ttfs_ratio" in report[name]:
            report[f"{name}_ttfs_ratio"] = report[name]["ttfs_ratio"]
            report[f"{name}_total_ratio"] = report[name]["total_ratio"]
    # The backend's own launch (call → worker function entry of a raw run): paid by every run, the
    # magic's included, unless the workers outlive the run.
    report["backend_launch_s"] = report["warm"]["raw"]["parts"].get("backend_launch")
    report["seconds"] = time.monotonic() - began
    report["load_average"] = {"start": load_start, "end": os.getloadavg()[0]}


def print_backend_launch(report: dict, what: str) -> None:
    raw_warm = report["warm"]["raw"]["ttfs"]["median"]
    print(f"  {what} (call → worker function entry), warm: {report['backend_launch_s']:.2f} s of raw's "
          f"{raw_warm:.2f} s; the target for the magic's warm time to first step is half of raw's: "
          f"{raw_warm / 2:.2f} s")


def print_comparison(report: dict, raw_name: str) -> None:
    """The cold/warm table (min-max in brackets) and each side's parts of the time to first step."""
    for mode in ("cold", "warm"):
        s = report.get(mode) or {}
        if "ttfs_ratio" not in s:
            continue
        for key, label in (("ttfs", "time to first step"), ("total", "total")):
            m, r = s["magic"][key], s["raw"][key]
            print(f"  {mode} {label:18s}: magic {m['median']:6.2f} s ({m['min']:.2f}-{m['max']:.2f}, n={m['n']}), "
                  f"{raw_name} {r['median']:6.2f} s ({r['min']:.2f}-{r['max']:.2f}, n={r['n']}), "
                  f"ratio {s[f'{key}_ratio']:.2f}")
    for mode in ("cold", "warm"):
        s = report.get(mode) or {}
        for via, name in (("magic", "magic"), ("raw", raw_name)):
            if via in s and s[via].get("parts"):
                print(f"  {mode} time to first step, {name}, parts (medians):")
                print("\n".join(format_parts(s[via]["parts"])))


# -- warm re-runs through the next run's waiting workers (Spark and Ray standbys, docs/warm-reruns.md) --------

STANDBY_SERIES = {
    "magic": "warm re-run: the next run's workers launched ahead and waiting (the machine idle, as between cells)",
    "magic_immediate": "re-run started the moment the previous one returned (its workers still starting)",
    "magic_fresh": "a launch with no workers waiting (released first): what every run cost before standbys",
}


def standby_series(run_magic, launcher, repeats: int, log) -> dict[str, list]:
    """The magic's warm samples three ways (``STANDBY_SERIES``), ``repeats`` of each, interleaved; each sample
    says whether its run took waiting workers over (``claimed``)."""
    out: dict[str, list] = {name: [] for name in STANDBY_SERIES}

    def one(name: str) -> None:
        claims = launcher.standbys.claims
        sample = run_magic()
        sample["claimed"] = launcher.standbys.claims > claims
        out[name].append(sample)
        log(f"  {name:15s} {len(out[name])}: function entry {sample['entry']:6.2f} s, "
            f"first step {sample['ttfs']:6.2f} s, total {sample['total']:6.2f} s, "
            f"{sample['steps_per_s']:6.1f} steps/s, took waiting workers: {sample['claimed']}")

    for _ in range(repeats):
        launcher.release_standby("benchmark: a launch with no workers waiting")
        settle(5.0)
        one("magic_fresh")
        one("magic_immediate")
        standby = launcher.standbys.standby
        if standby is not None:
            standby.all_ready.wait(300)
        settle(5.0)
        one("magic")
    return out


def print_standby(report: dict, raw_name: str, entry_target: float) -> None:
    """Warm re-runs through waiting workers against the raw API's call → function entry (issue 15's targets)."""
    s = report["standby"]
    raw = report["warm"]["raw"]
    raw_entry = statistics.median(x["entry"] for x in report["samples"]["warm"]["raw"])
    print(f"  call → worker function entry, warm (medians): {raw_name} {raw_entry:.2f} s")
    for name, label in STANDBY_SERIES.items():
        if name in s:
            x = s[name]
            print(f"    magic, {label}:\n      entry {x['entry']['median']:.2f} s ({x['entry']['min']:.2f}-"
                  f"{x['entry']['max']:.2f}) = {x['entry']['median'] / raw_entry:.3f} × raw; first step "
                  f"{x['ttfs']['median']:.2f} s; {x['steps_per_s']['median']:.1f} steps/s (raw "
                  f"{raw['steps_per_s']['median']:.1f}); took waiting workers {x['claimed']}/{x['entry']['n']}")
    print(f"    target: warm re-run entry ≤ {entry_target} × raw and ≤ 0.5 s; the immediate re-run no slower than the "
          f"fresh launch")


def standby_section(series: dict[str, list]) -> dict:
    out = {}
    for name, samples in series.items():
        out[name] = {k: summarize([x[k] for x in samples]) for k in ("entry", "ttfs", "total", "steps_per_s")}
        out[name]["claimed"] = sum(1 for x in samples if x.get("claimed"))
    return out


def write_json(path: str | None, data: object, indent: int = 2) -> None:
    """A benchmark's ``--json`` result (its folder made if needed); nothing without a path."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as handle:
        json.dump(data, handle, indent=indent)


def close_report(report: dict, json_path: str | None, workdir: str, began: float, load_start: float) -> None:
    """A benchmark's end, whatever happened: its seconds and load average in ``report``, the JSON written, its temp
    ``workdir`` removed (after leaving it), and the one line it ends with."""
    import shutil

    report["seconds"] = time.monotonic() - began
    report["load_average"] = {"start": load_start, "end": os.getloadavg()[0]}
    write_json(json_path, report)
    os.chdir("/")
    shutil.rmtree(workdir, ignore_errors=True)
    print(f"({report['seconds']:.0f} s; load average {load_start:.1f} → {report['load_average']['end']:.1f})")
