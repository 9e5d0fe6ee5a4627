"""Peak memory per rank of models bigger than one process (issue #26), against the estimate printed before launch.

Two parts, each through ``%%distribute --backend local`` (a real IPython shell with the extension loaded), CPU, fp32,
Adam; every rank measures its peak resident memory above its own start (``VmHWM`` after resetting it, imports of
torch, DeepSpeed, safetensors and torch.distributed.checkpoint done before: what the model, its training and the
strategy add), and the time its ``ctx.prepare`` took (build + load):

* ``--part mlp``: the issue's MLP of 134 M parameters (8 x Linear(4096, 4096)), 2 processes: DDP, FSDP and ZeRO 0-3
  built the plain way, and FSDP and ZeRO-3 built deferred (``ctx.prepare(make_model, ...)``). Targets: ZeRO-3 <= 0.6 x
  DDP's peak, FSDP <= 0.55 x, every estimate within +-25 % of its measured peak.
* ``--part large``: an MLP of about 0.5 B parameters (30 x Linear(4096, 4096)), saved once as safetensors. One process
  (``-n 1``) builds it, loads the state dict and trains (the reference peak); then 4 processes build it deferred and
  load it sharded (``weights=``): FSDP and ZeRO-3 <= 0.35 x the one process's peak, ``--tp 2`` (2 replicas of 2
  shards) <= 0.6 x, estimates within +-25 %. Also the build + load time of each against the plain path (the one
  process's build + ``load_state_dict``).

    .venv/bin/python benchmarks/bench_big_models.py --part mlp
    .venv/bin/python benchmarks/bench_big_models.py --part large --layers 30      # about 8.5 GiB at its peak (-n 1)
    .venv/bin/python benchmarks/bench_big_models.py --part mlp --only ddp,zero3_deferred --steps 2

The estimate is ``dtrain_magic.strategies.memory.estimate`` for the model's `ModelFacts` with the strategy's own sizes
(``Strategy.memory_settings``), the numbers rank 0 prints at ``ctx.prepare`` and the dry run prints before launch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

HELPERS = '''
import time
import torch

WIDTH, LAYERS, MICRO, STEPS = {width}, {layers}, {micro}, {steps}

def make_model():
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])
'''

CELL = '''%%distribute --backend local -n {n} --cpu --no-ui {flags}
DEFERRED, WEIGHTS = {deferred}, {weights!r}

def measure(ctx):
    if ctx.config.strategy == "deepspeed":
        import deepspeed  # noqa: F401  its import is part of the baseline, not of the model's memory
    import safetensors.torch, torch.distributed.checkpoint  # noqa: F401  likewise

    def status():
        with open("/proc/self/status") as handle:
            fields = dict(line.split(":", 1) for line in handle)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024

    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # the peak (VmHWM) starts again from here
    base = status()[0]
    started = time.perf_counter()
    if DEFERRED:
        model, opt = ctx.prepare(make_model, lambda params: torch.optim.Adam(params, lr=1e-4), weights=WEIGHTS)
    else:  # the plain way: every rank builds the whole model, then loads the whole state dict
        model = make_model()
        if WEIGHTS:
            from safetensors.torch import load_file
            model.load_state_dict(load_file(WEIGHTS))
        model, opt = ctx.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-4))
    prepare_s = time.perf_counter() - started
    prepare_peak = status()[1] - base
    g = torch.Generator().manual_seed(ctx.rank)
    x, y = torch.randn(MICRO, WIDTH, generator=g), torch.randn(MICRO, WIDTH, generator=g)
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        ctx.backward(loss)
        ctx.step()
        times.append(time.perf_counter() - start)
    return dict(peak=status()[1] - base, prepare_peak=prepare_peak, prepare_s=prepare_s, step_s=min(times),
                loss=loss.item())
'''

MLP_CASES = [
    # (name, flags, strategy, zero, deferred)
    ("ddp", "--strategy ddp", "ddp", None, False),
    ("fsdp", "--strategy fsdp", "fsdp", None, False),
    ("fsdp_deferred", "--strategy fsdp", "fsdp", None, True),
    ("zero0", "--zero 0", "deepspeed", 0, False),
    ("zero1", "--zero 1", "deepspeed", 1, False),
    ("zero2", "--zero 2", "deepspeed", 2, False),
    ("zero3", "--zero 3", "deepspeed", 3, False),
    ("zero3_deferred", "--zero 3", "deepspeed", 3, True),
]

LARGE_CASES = [
    # (name, flags, processes, strategy, zero, tp, deferred + sharded load)
    ("one_process", "--strategy ddp", 1, "ddp", None, 1, False),
    ("fsdp_deferred", "--strategy fsdp", 4, "fsdp", None, 1, True),
    ("zero3_deferred", "--zero 3", 4, "deepspeed", 3, 1, True),
    ("tp2_deferred", "--tp 2", 4, "ddp", None, 2, True),
]


def estimate_for(namespace: dict, strategy: str, zero: int | None, n: int, tp: int, flags: str):
    """What rank 0 prints at ctx.prepare (and the dry run before launch): the estimate for the model's facts."""
    import torch

    from dtrain_magic.api import config_from_options
    from dtrain_magic.strategies import get_strategy
    from dtrain_magic.strategies.memory import estimate, model_facts

    with torch.device("meta"):
        facts = model_facts(namespace["make_model"]())
    options = {"strategy": strategy, "num_processes": n, "use_gpu": False, "tp": tp}
    if zero is not None:
        options["zero"] = zero
    if strategy == "deepspeed":
        options["micro_batch"] = namespace["MICRO"]
    config = config_from_options(options)
    settings = get_strategy(strategy).memory_settings(config, facts)
    return estimate(facts.num_params, strategy, zero, "fp32", n, tp=tp, facts=facts, settings=settings)


def run_case(shell, name: str, flags: str, n: int, deferred: bool, weights: str | None) -> dict:
    line = CELL.format(n=n, flags=flags, deferred=deferred, weights=weights)
    print(f"\n=== {name}: {line.splitlines()[0]}", flush=True)
    started = time.monotonic()
    result = shell.run_cell(line)
    if result.error_in_exec is not None:
        print(f"{name}: FAILED: {result.error_in_exec}", flush=True)
        return {"name": name, "error": str(result.error_in_exec)[:2000]}
    values = result.result.values
    return {"name": name, "n": n, "peak": max(v["peak"] for v in values), "peaks": [v["peak"] for v in values],
            "prepare_peak": max(v["prepare_peak"] for v in values),
            "prepare_s": max(v["prepare_s"] for v in values), "step_s": max(v["step_s"] for v in values),
            "wall_s": time.monotonic() - started}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("mlp", "large"), default="mlp")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=None, help="Linear layers (default: 8 for mlp, 30 for large)")
    parser.add_argument("--micro", type=int, default=8, help="samples per process and step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", default=None, help="comma-separated subset of the part's cases")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    layers = args.layers or (8 if args.part == "mlp" else 30)

    from IPython.core.interactiveshell import InteractiveShell

    from dtrain_magic.strategies.memory import format_bytes

    workdir = tempfile.mkdtemp(prefix="dtrain_bench_big_")
    os.chdir(workdir)
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{workdir}/mlflow.db")
    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext dtrain_magic", store_history=False)
    helpers = HELPERS.format(width=args.width, layers=layers, micro=args.micro, steps=args.steps)
    shell.run_cell(helpers)
    namespace = shell.user_ns
    only = set(args.only.split(",")) if args.only else None
    rows: list[dict] = []
    if args.part == "mlp":
        cases = [(name, flags, 2, strategy, zero, 1, deferred) for name, flags, strategy, zero, deferred in MLP_CASES]
        weights = None
    else:
        cases = LARGE_CASES
        weights = os.path.join(workdir, "model.safetensors")
        import torch
        from safetensors.torch import save_file

        torch.manual_seed(0)
        started = time.monotonic()
        save_file(namespace["make_model"]().state_dict(), weights)
        print(f"checkpoint: {os.path.getsize(weights) / 2**30:.2f} GiB written in {time.monotonic() - started:.1f} s",
              flush=True)
    for name, flags, n, strategy, zero, tp, deferred in cases:
        if only and name not in only:
            continue
        row = run_case(shell, name, flags, n, deferred, weights)
        if "error" not in row:
            est = estimate_for(namespace, strategy, zero, n, tp, flags)
            row.update(estimate=est.total, est_states=est.states, est_buffers=est.buffers, params=est.num_params,
                       est_parts=list(est.buffer_parts))
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "est_parts"}), flush=True)
    if weights and os.path.exists(weights):
        os.remove(weights)

    base_name = "ddp" if args.part == "mlp" else "one_process"
    base = next((r for r in rows if r["name"] == base_name and "error" not in r), None)
    params = next((r["params"] for r in rows if "params" in r), 0)
    print(f"\n{params:,} parameters, {args.part}, micro batch {args.micro}, {args.steps} steps; peak = resident memory "
          f"per rank above its start (the largest rank)")
    print(f"{'case':<16}{'procs':>6}{'peak':>12}{'x base':>8}{'estimate':>12}{'est/peak':>9}{'build+load s':>14}"
          f"{'step s':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<16} failed: {r['error'][:100]}")
            continue
        ratio = f"{r['peak'] / base['peak']:.2f}" if base else "-"
        print(f"{r['name']:<16}{r['n']:>6}{format_bytes(r['peak']):>12}{ratio:>8}{format_bytes(r['estimate']):>12}"
              f"{r['estimate'] / r['peak']:>9.2f}{r['prepare_s']:>14.1f}{r['step_s']:>8.2f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"part": args.part, "layers": layers, "width": args.width, "rows": rows}, handle, indent=2)
    return rows


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
