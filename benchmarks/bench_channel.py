"""The cost of ``ctx.log`` on the channel: a worker process logging metrics as fast as it can, the notebook
side receiving and handling them (the message pump, MLflow not attached: metrics wait for it).

One sender process (``TrainContext.log`` with the rank's `Pulse`, over a real `WorkerLink`, as in a worker: the
values are batched, four `Metrics` messages a second; thinning off here, so every value arrives) and this process
(a real `Channel`, its reader thread, ``Pump.handle``). Per logged value: the sender's CPU time (its training
thread and reporter thread together), the receiver's CPU time (reader thread and pump together), and the wall
time from the first send to the last value handled. Medians over ``--repeats``. No MLflow, no
torch.distributed: only the channel path every ``ctx.log`` takes.

    .venv/bin/python benchmarks/bench_channel.py                 # 20000 metrics, 5 repeats
    .venv/bin/python benchmarks/bench_channel.py --messages 50000 --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from workload import write_json

_SENDER = r"""
import os, sys, time
os.environ["DTRAIN_MAGIC_METRIC_RATE"] = "1e12"  # no thinning: every value crosses
import torch
from dtrain_magic.channel import ChannelAddress, WorkerLink
from dtrain_magic.config import RunConfig
from dtrain_magic.worker.context import TrainContext
from dtrain_magic.worker.pulse import Pulse

host, port, key, n = sys.stdin.readline().split()
link = WorkerLink(ChannelAddress(host, int(port), bytes.fromhex(key)), rank=0)
pulse = Pulse(0, link.send)
ctx = TrainContext(RunConfig(num_processes=1), None, 0, 0, 1, torch.device("cpu"), send=link.send, pulse=pulse)
cpu = time.process_time()
for step in range(int(n)):
    ctx.log(loss=0.5 + step * 1e-6, lr=1e-3, epoch=step // 1000)
pulse.close()
cpu = time.process_time() - cpu
link.close()
print(cpu, flush=True)
"""


def one_sample(messages: int) -> dict:
    from dtrain_magic.channel import Channel
    from dtrain_magic.config import RunConfig
    from dtrain_magic.driver.observer import RunObserver
    from dtrain_magic.driver.pump import Pump

    with Channel() as channel:
        pump = Pump(RunConfig(num_processes=1), channel, RunObserver(), time.monotonic())
        sender = subprocess.Popen(
            [sys.executable, "-c", _SENDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        address = channel.address
        sender.stdin.write(f"{address.host} {address.port} {address.authkey.hex()} {messages}\n")
        sender.stdin.flush()
        first = channel.get(timeout=60)  # the sender's interpreter start and torch import are not timed
        if first is None:
            raise RuntimeError("the sender sent nothing within 60 s")
        start, cpu = time.monotonic(), time.process_time()
        pump.handle(first)
        while len(pump.waiting_metrics) < messages:
            message = channel.get(timeout=30)
            if message is None:
                raise RuntimeError(f"only {len(pump.waiting_metrics)} of {messages} metrics arrived")
            pump.handle(message)
        wall, cpu = time.monotonic() - start, time.process_time() - cpu
        sender_cpu = float(sender.communicate(timeout=60)[0].strip())
    return {
        "sender_cpu_us": sender_cpu / messages * 1e6,
        "receiver_cpu_us": cpu / messages * 1e6,
        "wall_us": wall / messages * 1e6,
        "messages_per_s": messages / wall,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the samples and medians here")
    args = parser.parse_args(argv)
    samples = [one_sample(args.messages) for _ in range(args.repeats)]
    medians = {key: statistics.median(s[key] for s in samples) for key in samples[0]}
    print(f"ctx.log over the channel, {args.messages} metrics, median of {args.repeats}:")
    for key, value in medians.items():
        spread = f"({min(s[key] for s in samples):.1f}-{max(s[key] for s in samples):.1f})"
        print(f"  {key:<16} {value:10.1f} {spread}")
    write_json(args.json, {"samples": samples, "median": medians, "messages": args.messages})
    return medians


if __name__ == "__main__":
    main()
