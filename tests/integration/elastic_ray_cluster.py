"""A notebook of its own for test_elastic_ray.py: a Ray of two one-CPU nodes on this machine
(`ray.cluster_utils.Cluster`, a head with no CPU and two raylets), and a ``dtrain_magic.run(..., backend="ray",
num_processes=2, elastic="1:2", max_restarts=1)`` on it. Rank 1's node is removed mid-run (as a drained spot node
leaves: its raylet told to stop); the run goes on on the other node; a node is added back and, when the survivor's
function raises once, the restart grows the run back to two workers. Writes ``outcome.pt`` (the run's value, world
size, run id) in the working directory, which the test compares with one plain process.

Run as ``python elastic_ray_cluster.py`` in a fresh directory with ``MLFLOW_TRACKING_URI`` set; the main thread drives
the cluster (Ray's ``add_node`` must run there), the run goes on in a thread.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import ray
import torch
from ray.cluster_utils import Cluster

import dtrain_magic

ROWS, MICRO, EPOCHS, SAVE_EVERY, LOSE_AT, FAIL_AT, DRAIN_AT = 64, 4, 4, 3, 10, 19, 24


def rows() -> dict:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, 8, generator=g)
    return {"id": np.arange(ROWS, dtype=np.int64), "x": x.numpy(), "y": x.sum(1, keepdim=True).sin().numpy()}


def train(ctx, here: str):
    import os
    import time

    import ray
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model, opt = ctx.prepare(model, opt)
    loader = ctx.data("rows", batch_size=MICRO)
    ctx.load_checkpoint()
    done = first = ctx.optimizer_steps  # first: where this attempt began (also from a preemption's checkpoint)
    mark = os.path.join(here, f"began_{ctx.world_size}_{first}")
    open(mark, "w").write(str(time.time()))
    log = open(os.path.join(here, f"read_{os.getpid()}_{first}.txt"), "w")
    for epoch in range(loader.epoch, EPOCHS):
        loader.set_epoch(epoch)
        for batch in loader:
            log.write(f"{first} {done + 1} {epoch} " + " ".join(map(str, batch["id"].tolist())) + "\n")
            log.flush()
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            ctx.backward(loss)
            if ctx.step():
                done += 1
                if done % SAVE_EVERY == 0:
                    ctx.save_checkpoint(done=done)
                if done == LOSE_AT and ctx.rank == 1 and not os.path.exists(os.path.join(here, "lose")):
                    # the driver removes this rank's node; it waits here meanwhile (its peer waits in the next step)
                    open(os.path.join(here, "lose"), "w").write(ray.get_runtime_context().get_node_id())
                    time.sleep(120)
                if done == FAIL_AT and ctx.world_size == 1 and not os.path.exists(os.path.join(here, "raised")):
                    open(os.path.join(here, "raised"), "w").write(str(time.time()))
                    raise RuntimeError("a bug, once: the restart grows the run back")
                if ctx.world_size == 2 and first > 0:  # the grown attempt: Ray drains a node at DRAIN_AT
                    if done == DRAIN_AT and ctx.rank == 1:
                        open(os.path.join(here, "drain"), "w").write(ray.get_runtime_context().get_node_id())
                    # steps slower than the notice (Ray Train's watcher polls every 0.5 s here), all of them: the
                    # ranks check for a notice every ~50 ms of steps, as long steps as the attempt's first ones
                    time.sleep(0.25)
    return {"world": ctx.world_size, "weights": ctx.full_state_dict()}


def wait_for(path: str, within_s: float) -> str:
    end = time.monotonic() + within_s
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"{path} never came")
        time.sleep(0.1)
    time.sleep(0.1)  # (written and closed)
    return open(path).read()


def drain(node_id: str, deadline_s: float) -> None:
    """Ray's drain of a node for a preemption (what a cloud's spot reclaim notice becomes on a Ray cluster)."""
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    accepted, why = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                   "a spot instance reclaimed (test)", int(time.time() * 1000 + deadline_s * 1000))
    assert accepted, why
    open("drained", "w").write(str(time.time()))


def wait_for_marker_after(here: str, prefix: str, since: float, within_s: float) -> None:
    """Until an attempt on one worker began after ``since`` (its ``began_1_<step>`` marker)."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        for path in os.listdir(here):
            if path.startswith(prefix) and float(open(os.path.join(here, path)).read() or 0) > since:
                return
        time.sleep(0.2)
    raise TimeoutError("no attempt on one worker after the drain")


def main() -> None:
    here = os.getcwd()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = {}
    for _ in range(2):
        node = cluster.add_node(num_cpus=1)
        nodes[node.node_id] = node
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    outcome: dict = {}

    def fit() -> None:
        try:
            result = dtrain_magic.run(train, here, backend="ray", num_processes=2, elastic="1:2", max_restarts=1,
                                      cpu=True, data={"rows": rows()}, storage=os.path.join(here, "storage"),
                                      no_ui=True)
            outcome.update(value=result.value, world=result.world_size, values=len(result.values),
                           run_id=result.run_id)
        except BaseException as exc:  # the test shows it
            outcome["error"] = repr(exc)

    runner = threading.Thread(target=fit)
    runner.start()
    lost = wait_for(os.path.join(here, "lose"), 240)
    removed_at = time.time()
    cluster.remove_node(nodes[lost])  # graceful: its raylet stops and tells the GCS, as a drained node does
    open(os.path.join(here, "removed"), "w").write(str(removed_at))
    wait_for(os.path.join(here, f"began_1_{LOSE_AT - LOSE_AT % SAVE_EVERY}"), 120)  # the survivor resumed
    node = cluster.add_node(num_cpus=1)  # capacity comes back: the next relaunch (the restart) grows the run
    nodes[node.node_id] = node
    cluster.wait_for_nodes()
    draining = wait_for(os.path.join(here, "drain"), 240)  # the grown run's rank 1: its node is reclaimed
    drained_at = time.time()
    drain(draining, deadline_s=120)
    wait_for_marker_after(here, "began_1_", drained_at, 120)  # every rank checkpointed; the survivor goes on alone
    cluster.remove_node(nodes[draining])  # the reclaimed node goes, as the cloud takes it at the deadline
    runner.join(300)
    torch.save(outcome, os.path.join(here, "outcome.pt"))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main()
