"""Each big-model knob (issue #38) on a small GPT-2 built from a config (no download), 2 processes, fp32, AdamW: peak
resident memory per rank and the median step time of the magic's run with the knob against its run without it, and
against accelerate with the same settings (its FSDP plugin, its DeepSpeed plugin) in the same run.

    .venv/bin/python benchmarks/bench_knobs.py                       # FSDP and ZeRO-3; none, --ac full/selective,
                                                                     # --clip-grad 1.0, LoRA, --offload
    .venv/bin/python benchmarks/bench_knobs.py --only fsdp:ac_full --steps 4
    .venv/bin/python benchmarks/bench_knobs.py --compile             # also --compile (about a minute per block
                                                                     # class to compile on a 2-core CPU)
    .venv/bin/python benchmarks/bench_knobs.py --gpu                 # GPUs: CUDA peak memory, --offload runs

The magic's side is ``dtrain_magic.run(train, backend="local", n=2, ...)`` with the knob's flag; accelerate's is the
same model, batches and loop under ``Accelerator(...)`` in 2 processes started by torch's ``elastic_launch`` (what
``accelerate launch`` runs). Each rank measures what it adds above its start, imports done (``VmHWM`` after reset on a
CPU, ``torch.cuda.max_memory_allocated`` on a GPU), and the median of its steps after the first two.

What accelerate does on a CPU is part of the result, in each row's "ran as": accelerate 1.16 applies its FSDP plugin
only on accelerators (on a CPU it runs DDP, ``MULTI_CPU``: the plugin's activation checkpointing is then done with
transformers' ``gradient_checkpointing_enable``, what such a user would write), and its DeepSpeed plugin runs ZeRO-3
on 2 ranks while its own state counts one process (each rank's batch is picked here by its torch rank, as on the
magic's side). Selective checkpointing and per-block compile have no accelerate setting: their rows have the magic's
side only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import settle  # noqa: E402

MODEL = dict(vocab_size=4096, n_positions=256, n_embd=256, n_layer=6, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
             attn_pdrop=0.0)
STRATEGIES = {"fsdp": {"strategy": "fsdp"}, "zero3": {"zero": 3}}
# knob -> (the magic's options, what accelerate is given: None where it has no such setting)
# --offload: FSDP2 offloads parameters, gradients and the step together (the magic refuses "optimizer" for it), as
# accelerate's FSDP plugin's cpu_offload; ZeRO-3 the optimizer's states, as its DeepSpeed plugin's offload_optimizer
OFFLOAD = {"fsdp": "params", "zero3": "optimizer"}
KNOBS = {
    "none": ({}, {}),
    "ac_full": ({"ac": "full"}, {"ac": True}),
    "ac_selective": ({"ac": "selective"}, None),
    "clip_grad": ({"clip_grad": 1.0}, {"clip": 1.0}),
    "lora": ({}, {}),
    "offload": ({"offload": "(per strategy)"}, {"offload": True}),
    "compile": ({"compile": True}, None),
}


def make_model(lora: bool):
    """The GPT-2 of every case, the same weights on every rank; with LoRA adapters on its attention and MLP inputs."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**MODEL))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, fan_in_fan_out=True,
                                                 target_modules=["c_attn", "c_fc"]))
    return model


class Meter:
    """What a rank adds above its start (imports done): peak memory, and its step times."""

    def __init__(self, gpu: bool):
        import torch

        self.gpu, self.times = gpu, []
        if gpu:
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")  # the peak (VmHWM) starts again from here
            self.base = self._status()[0]

    @staticmethod
    def _status() -> tuple[int, int]:
        with open("/proc/self/status") as handle:
            fields = dict(line.split(":", 1) for line in handle)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024

    def peak(self) -> int:
        import torch

        return (torch.cuda.max_memory_allocated() if self.gpu else self._status()[1]) - self.base

    def train(self, step, rank: int, shape: dict) -> dict:
        """``step(ids)`` -> loss, for ``shape["steps"]`` batches of this rank's own tokens."""
        import torch

        generator = torch.Generator().manual_seed(rank)
        device = torch.device("cuda", torch.cuda.current_device()) if self.gpu else torch.device("cpu")
        for _ in range(shape["steps"]):
            ids = torch.randint(0, MODEL["vocab_size"], (shape["micro"], shape["seq"]), generator=generator).to(device)
            started = time.perf_counter()
            loss = step(ids)
            self.times.append(time.perf_counter() - started)
        return {"peak": self.peak(), "step_s": statistics.median(self.times[2:] or self.times), "loss": loss.item(),
                "rank": rank}


def preload(deepspeed: bool) -> None:
    """Imports every side makes, before its meter starts: the model's memory, not the libraries'."""
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    if deepspeed:
        import deepspeed as _  # noqa: F401


def magic_train(ctx, lora: bool, shape: dict, gpu: bool) -> dict:
    """The magic's side: the knob is the run's flag, the loop the same as accelerate's."""
    import torch

    preload(ctx.config.strategy == "deepspeed")
    meter = Meter(gpu)
    model, opt = ctx.prepare(make_model(lora), lambda params: torch.optim.AdamW(params, lr=1e-4))

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        ctx.backward(loss)
        ctx.step()
        return loss

    return meter.train(step, ctx.rank, shape)


def accelerator_for(strategy: str, settings: dict, shape: dict, gpu: bool):
    """accelerate's own way to the same settings: its FSDP plugin (FSDP2, per GPT-2 block) or its DeepSpeed plugin."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    if strategy == "fsdp":
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, activation_checkpointing=bool(settings.get("ac")),
            cpu_offload=bool(settings.get("offload")), auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["GPT2Block"])
        return Accelerator(fsdp_plugin=plugin, cpu=not gpu)
    zero = {"stage": 3}
    if settings.get("offload"):
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": shape["micro"], "train_batch_size": shape["micro"] * shape["n"],
              "gradient_accumulation_steps": 1, "gradient_clipping": settings.get("clip", 0.0),
              "zero_optimization": zero}
    return Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))


def accelerate_train(strategy: str, settings: dict, lora: bool, shape: dict, gpu: bool) -> dict:
    """accelerate's side, in each process ``elastic_launch`` started."""
    import torch
    import torch.distributed as dist
    from accelerate.utils import DistributedType

    torch.set_num_threads(1)  # as the magic's local launcher gives each of 2 workers on 2 cores
    preload(strategy == "zero3")
    meter = Meter(gpu)
    accelerator = accelerator_for(strategy, settings, shape, gpu)
    model = make_model(lora)
    ran_as = accelerator.distributed_type.value
    if settings.get("ac") and accelerator.distributed_type != DistributedType.FSDP:
        # the plugin's checkpointing is FSDP's; elsewhere an accelerate user turns on transformers' own
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ran_as += " + gradient_checkpointing_enable"
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    clip = settings.get("clip") if accelerator.distributed_type != DistributedType.DEEPSPEED else None

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        if clip:
            accelerator.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        return loss

    return {**meter.train(step, dist.get_rank(), shape), "ran_as": ran_as,
            "accelerate_processes": accelerator.num_processes}


def ranks_summary(values: list[dict]) -> dict:
    """The largest rank's peak, rank 0's step time and loss."""
    first = min(values, key=lambda value: value["rank"])
    return {"peak": max(value["peak"] for value in values), "step_s": first["step_s"], "loss": first["loss"],
            **{key: first[key] for key in ("ran_as", "accelerate_processes") if key in first}}


def run_magic(strategy: str, knob: str, shape: dict, gpu: bool) -> dict:
    import dtrain_magic
    from dtrain_magic.errors import ConfigError

    options = {**STRATEGIES[strategy], **KNOBS[knob][0]}
    if "offload" in options:
        options["offload"] = OFFLOAD[strategy]
    try:
        result = dtrain_magic.run(magic_train, lora=knob == "lora", shape=shape, fn_kwargs={"gpu": gpu}, gpu=gpu,
                                  backend="local", num_processes=shape["n"], ui=False, **options)
    except ConfigError as error:  # a knob refused before launch (--offload on a CPU run): that is its result
        return {"refused": str(error).splitlines()[0]}
    return ranks_summary(result.values)


def run_accelerate(strategy: str, knob: str, shape: dict, gpu: bool) -> dict | None:
    settings = KNOBS[knob][1]
    if settings is None:
        return None
    if settings.get("offload") and not gpu:
        return {"refused": "nothing to offload to on a CPU run (not measured)"}
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=shape["n"], run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, start_method="spawn")
    try:
        values = elastic_launch(config, accelerate_train)(strategy, settings, knob == "lora", shape, gpu)
    except Exception as error:  # one side failing is a row of the report, not the end of the benchmark
        return {"error": str(error).strip().splitlines()[-1][:300]}
    return ranks_summary(list(values.values()))


def cases(args: argparse.Namespace) -> list[tuple[str, str]]:
    knobs = [knob for knob in KNOBS if knob != "compile" or args.compile]
    every = [(strategy, knob) for strategy in STRATEGIES for knob in knobs]
    only = set(args.only.split(",")) if args.only else None
    return [(s, k) for s, k in every if only is None or f"{s}:{k}" in only or s in only]


def ratio(mine: dict | None, theirs: dict | None, key: str) -> float | None:
    if not mine or not theirs or key not in mine or not theirs.get(key):
        return None
    return mine[key] / theirs[key]


def print_table(rows: list[dict]) -> None:
    from dtrain_magic.strategies.memory import format_bytes

    def cell(side: dict | None, key: str) -> str:
        if side is None:
            return "-"
        if key not in side:
            return "refused" if "refused" in side else "failed"
        return format_bytes(side[key]) if key == "peak" else f"{side[key]:.3f}"

    def times(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    print(f"\n{'case':<20}{'peak':>11}{'x none':>8}{'step s':>9}{'x none':>8}{'acc peak':>11}{'/acc':>7}"
          f"{'acc step':>10}{'/acc':>7}  accelerate ran as")
    for row in rows:
        magic, acc = row["magic"], row["accelerate"]
        print(f"{row['case']:<20}{cell(magic, 'peak'):>11}{times(row['peak_vs_none']):>8}{cell(magic, 'step_s'):>9}"
              f"{times(row['step_vs_none']):>8}{cell(acc, 'peak'):>11}{times(row['peak_vs_accelerate']):>7}"
              f"{cell(acc, 'step_s'):>10}{times(row['step_vs_accelerate']):>7}  {(acc or {}).get('ran_as', '')}")
    for row in rows:
        for side in ("magic", "accelerate"):
            found = row[side] or {}
            if "refused" in found or "error" in found:
                print(f"  {row['case']}, {side}: {found.get('refused') or found.get('error')}")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=2, help="processes on each side")
    parser.add_argument("--micro", type=int, default=4, help="sequences per process and step")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=12, help="steps per run (the first two are not timed)")
    parser.add_argument("--only", default=None, help="comma-separated strategies or strategy:knob cases")
    parser.add_argument("--compile", action="store_true", help="also the --compile case (slow on a CPU)")
    parser.add_argument("--gpu", action="store_true", help="GPUs: CUDA memory, NCCL, --offload measured")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="dtrain_bench_knobs_")
    os.chdir(workdir)
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{workdir}/mlflow.db")
    shape = {"n": args.n, "micro": args.micro, "seq": args.seq, "steps": args.steps}
    rows, nones = [], {}
    for strategy, knob in cases(args):
        started = time.monotonic()
        settle()  # the last run's workers gone, the next run's launched ahead and idle: no side pays for another
        magic = run_magic(strategy, knob, shape, args.gpu)
        settle()
        acc = run_accelerate(strategy, knob, shape, args.gpu)
        if knob == "none":
            nones[strategy] = magic
        base = nones.get(strategy)
        row = {"case": f"{strategy}:{knob}", "magic": magic, "accelerate": acc,
               "peak_vs_none": ratio(magic, base, "peak"), "step_vs_none": ratio(magic, base, "step_s"),
               "peak_vs_accelerate": ratio(magic, acc, "peak"), "step_vs_accelerate": ratio(magic, acc, "step_s"),
               "seconds": time.monotonic() - started}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\nGPT-2 {MODEL}, {args.n} processes, {args.micro} x {args.seq} tokens per process and step, "
          f"{args.steps} steps; peak = memory per rank above its start (the largest rank); x none = against the same "
          f"strategy without a knob; /acc = the magic / accelerate with the same settings")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"model": MODEL, "shape": shape, "gpu": args.gpu, "rows": rows}, handle, indent=2)
    return rows


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
