"""Step time and peak per-process memory of every strategy/stage relative to DDP, in one run.

Runs the same training function through ``%%distribute --backend local`` (a real IPython shell with
the extension loaded) once per strategy: ddp, fsdp, deepspeed ZeRO 0/1/2/3. Each run trains an MLP
of ``--layers`` x ``--width`` x ``--width`` Linear layers with Adam; every rank measures the median
step time after ``--warmup`` steps and its memory:

* CPU: peak RSS (``ru_maxrss``) minus the RSS before the model was built (torch and DeepSpeed already
  imported), i.e. what the model, gradients, optimizer states and communication buffers added;
  also the peak live heap (glibc ``mallinfo2``: bytes allocated and not yet freed, sampled after the
  forward, the backward and the step of every step, above the value before the model was built), which
  shows what the strategy keeps alive better than RSS (freed memory stays in RSS);
* GPU (``--gpu``, see bench_strategies_gpu.py): ``torch.cuda.max_memory_allocated``.

It also prints the ZeRO-paper estimate (dtrain_magic.strategies.memory) and the measured optimizer-state bytes.

    .venv/bin/python benchmarks/bench_strategies.py                 # CPU, 2 processes, fp32
    .venv/bin/python benchmarks/bench_strategies.py --precision bf16 --width 1024
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from workload import write_json

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

CELL = '''
import os, resource, statistics, time
import torch

def bench(ctx):
    import psutil
    from dtrain_magic.strategies.memory import optimizer_state_bytes, count_parameters
    if ctx.config.strategy == "deepspeed":
        import deepspeed  # so its import is part of the baseline, not of the measurement
    gpu = ctx.device.type == "cuda"
    import ctypes

    class _Mallinfo2(ctypes.Structure):
        _fields_ = [(f, ctypes.c_size_t) for f in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]
    try:
        _libc = ctypes.CDLL("libc.so.6")
        _libc.mallinfo2.restype = _Mallinfo2
        def heap():  # bytes malloc has handed out and not yet had back (arena + mmapped chunks)
            info = _libc.mallinfo2()
            return info.uordblks + info.hblkhd
    except (OSError, AttributeError):
        heap = lambda: 0
    heap_base, heap_peak = heap(), 0
    def sample():
        nonlocal heap_peak
        heap_peak = max(heap_peak, heap() - heap_base)
    torch.manual_seed(0)
    layers = []
    for _ in range({layers}):
        layers += [torch.nn.Linear({width}, {width}), torch.nn.ReLU()]
    if gpu:
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = psutil.Process().memory_info().rss
    model = torch.nn.Sequential(*layers, torch.nn.Linear({width}, 1))
    n_params = count_parameters(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    X = torch.randn({micro} * {steps} * ctx.world_size, {width})
    Y = torch.randn({micro} * {steps} * ctx.world_size, 1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size={micro})
    model, opt, loader = ctx.prepare(model, opt, loader)
    times = []
    for x, y in loader:
        x, y = x.to(ctx.device), y.to(ctx.device)
        if gpu: torch.cuda.synchronize()
        start = time.perf_counter()
        with ctx.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        sample()
        ctx.backward(loss)
        sample()
        ctx.step()
        if gpu: torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        sample()
    if gpu:
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return dict(step_s=statistics.median(times[{warmup}:]), peak=peak, heap=heap_peak,
                opt_bytes=optimizer_state_bytes(opt), params=n_params, loss=loss.item())
'''

CASES = [
    ("ddp", "--strategy ddp", "ddp", None),
    ("fsdp", "--strategy fsdp", "fsdp", None),
    ("zero0", "--zero 0", "deepspeed", 0),
    ("zero1", "--zero 1", "deepspeed", 1),
    ("zero2", "--zero 2", "deepspeed", 2),
    ("zero3", "--zero 3", "deepspeed", 3),
]


def run(argv: list[str] | None = None, gpu: bool = False) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--num-processes", type=int, default=2)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro", type=int, default=8, help="micro batch per process")
    parser.add_argument("--steps", type=int, default=12, help="steps per process")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--only", default=None, help="comma-separated subset of " + ",".join(c[0] for c in CASES))
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)

    from IPython.core.interactiveshell import InteractiveShell

    from dtrain_magic.strategies.memory import estimate, format_bytes

    workdir = tempfile.mkdtemp(prefix="dtrain_bench_")
    os.chdir(workdir)
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{workdir}/mlflow.db")
    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext dtrain_magic", store_history=False)
    cell = CELL.format(layers=args.layers, width=args.width, micro=args.micro, steps=args.steps, warmup=args.warmup)
    device = "--gpu" if gpu else "--cpu"
    only = set(args.only.split(",")) if args.only else None
    rows = []
    for name, flags, strategy, zero in CASES:
        if only and name not in only:
            continue
        line = (f"%%distribute --backend local -n {args.num_processes} {device} --no-ui "
                f"--precision {args.precision} {flags}")
        print(f"\n=== {name}: {line}", flush=True)
        started = time.monotonic()
        result = shell.run_cell(line + "\n" + cell)
        if result.error_in_exec is not None:
            print(f"{name}: FAILED: {result.error_in_exec}")
            rows.append(dict(name=name, error=str(result.error_in_exec)))
            continue
        values = result.result.values
        est = estimate(values[0]["params"], strategy, zero, args.precision, args.num_processes)
        rows.append(dict(
            name=name, step_s=max(v["step_s"] for v in values), peak=max(v["peak"] for v in values),
            heap=max(v["heap"] for v in values),
            opt_bytes=max(v["opt_bytes"] for v in values), est_total=est.total, est_opt=est.optimizer,
            est_moments=est.optimizer_moments, params=values[0]["params"], wall_s=time.monotonic() - started,
        ))
    base = next((r for r in rows if r["name"] == "ddp" and "error" not in r), None)
    kind = "GPU max_memory_allocated" if gpu else "CPU peak RSS above baseline"
    print(f"\n{rows[0].get('params', 0):,} parameters, {args.num_processes} processes, {args.precision}, "
          f"micro batch {args.micro}, {args.steps} steps/process; memory = {kind}")
    header = (f"{'strategy':<8}{'step ms':>9}{'x DDP':>7}{'peak mem':>12}{'x DDP':>7}{'live heap':>12}{'x DDP':>7}"
              f"{'opt state':>12}{'x DDP':>7}{'estimate':>12}{'x DDP':>7}{'run s':>7}")
    print(header)

    def rel(row: dict, key: str) -> str:
        """``row[key]`` relative to DDP's."""
        return f"{row[key] / base[key]:.2f}" if base and base[key] else "-"

    for r in rows:
        if "error" in r:
            print(f"{r['name']:<8} failed: {r['error'][:100]}")
            continue
        print(f"{r['name']:<8}{r['step_s'] * 1000:>9.1f}{rel(r, 'step_s'):>7}"
              f"{format_bytes(r['peak']):>12}{rel(r, 'peak'):>7}"
              f"{format_bytes(r['heap']):>12}{rel(r, 'heap'):>7}"
              f"{format_bytes(r['opt_bytes']):>12}{rel(r, 'opt_bytes'):>7}{format_bytes(r['est_total']):>12}"
              f"{rel(r, 'est_total'):>7}{r['wall_s']:>7.1f}")
    write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run()
