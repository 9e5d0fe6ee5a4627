"""`run_worker`: one rank of a run, in named steps — connect, join, build ``ctx``, call, report, leave.

Whichever backend started the process, every worker runs this: it connects to the notebook's channel and
sends its Python-level output there line by line, joins (or adopts) the torch.distributed process group,
builds the strategy and the `TrainContext`, calls the user's function and sends back its result or its
error (with a traceback trimmed to the user's frames and labelled with the notebook's cell numbers). Before
its `Hello`, a rank registers its stack file (`pulse.install_stack_dump`: the notebook can see where it is,
even blocked in native code); from then on its `pulse.Pulse` reports its progress.
"""

from __future__ import annotations

import os
import random
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import cloudpickle

from .. import integrations
from ..channel import Error, Hello, Result, Status, Stopped, WorkerLink
from ..errors import StopAtStep, log_dropped, short_traceback, summary
from .job import RankInfo, WorkerJob, rank_from_env
from .process_group import barrier, device_for, ensure_process_group
from .pulse import Pulse, StackDump, install_stack_dump
from .streams import ChannelStream


@dataclass
class _Rank:
    """What one rank's run holds while it runs, for `_teardown` whatever happened."""

    job: WorkerJob
    ranks: RankInfo
    link: WorkerLink
    streams: tuple[Any, Any]
    owns_group: bool = False
    strategy: Any = None
    pulse: Pulse | None = None
    stacks: StackDump | None = None


def run_worker(job: WorkerJob, ranks: RankInfo | None = None, checkpoints: Any = None,
               preemption: tuple[Callable[[], bool], str] | None = None) -> Any:
    """Run the user's function on this rank; returns its value, raises its exception after reporting it.

    ``checkpoints``: a backend's own checkpoint store for ``ctx`` (Ray Train's); default: plain files
    under ``job.checkpoint_root``. ``preemption``: a backend's own preemption notice (a poll, and what it is in
    words: Ray's drain), instead of a SIGTERM (`worker.preempt`).
    """
    rank = _connect(job, ranks or rank_from_env())
    ctx = None
    try:
        device = _join(rank)
        if job.config.seed is not None:
            seed_everything(job.config.seed)
        ctx = _build_context(rank, device, checkpoints, preemption)
        try:
            value = _call(rank, ctx)
        except StopAtStep as stopped:  # every rank stops after this step, as the notebook asked: a clean end
            return _stopped(rank, device, stopped.step)
        _send_result(rank, value, ctx.seal_outputs())  # its ctx.write parts closed: the driver commits them
        if rank.owns_group:
            # Leave together: a rank that finished its last collective first (a broadcast's sender) must
            # not close its connections while a peer is still reading from them. A peer that failed makes
            # the notebook stop this worker; its result is already sent.
            try:
                barrier(device)
            except Exception as exc:  # a peer failed (the notebook stops this worker): the result is sent
                log_dropped(__name__, "run_worker", exc)
        return value
    except BaseException as exc:
        if ctx is not None:
            ctx.abort_outputs()  # nothing of a failed rank's ctx.write is committed
        _report_failure(rank, exc)
        raise
    finally:
        _teardown(rank)


def _connect(job: WorkerJob, ranks: RankInfo) -> _Rank:
    """Say hello to the notebook and send this process's Python-level output there from now on."""
    for key, value in job.env.items():
        os.environ.setdefault(key, value)
    link = WorkerLink(job.channel, ranks.rank)
    stacks = install_stack_dump(ranks.rank)
    link.send(Hello(ranks.rank, os.getpid(), socket.gethostname(), stacks.path if stacks else "", _node_id()))
    rank = _Rank(job, ranks, link, (sys.stdout, sys.stderr), stacks=stacks)
    rank.pulse = Pulse(ranks.rank, link.send, inbox=link)  # its thread also reads what the notebook writes
    sys.stdout = ChannelStream(link, ranks.rank, "stdout")
    sys.stderr = ChannelStream(link, ranks.rank, "stderr")
    return rank


def _node_id() -> str:
    """Ray's id of this machine when this process is a Ray worker (how the notebook reaches it on a cluster)."""
    ray = sys.modules.get("ray")
    if ray is None:
        return ""
    try:
        return (ray.get_runtime_context().get_node_id() or "") if ray.is_initialized() else ""
    except Exception as exc:  # a Ray half torn down: Hello names no node (no stacks from afar)
        log_dropped(__name__, "Ray's node id of this rank", exc)
        return ""


def _join(rank: _Rank) -> Any:
    """Join the process group (unless the backend did) and return this rank's device."""
    config = rank.job.config
    backend = rank.job.strategy_class().process_group_backend(config.use_gpu)
    rank.owns_group = ensure_process_group(backend, rank.ranks, config.timeout)
    device = device_for(config.use_gpu, rank.ranks.local_rank)
    if rank.owns_group:
        # init_process_group has no barrier of its own: without one, a rank whose function needs no
        # collective could finish and exit while a slower peer is still connecting to it.
        barrier(device)
    return device


def _build_context(rank: _Rank, device: Any, checkpoints: Any, preemption: tuple | None = None) -> Any:
    """The strategy and the `TrainContext` the user's function gets; integrations installed around it."""
    from ..data.outputs import outputs_root
    from .checkpoints import checkpoint_store
    from .context import TrainContext

    job, ranks = rank.job, rank.ranks
    rank.strategy = job.strategy_class()(job.config, ranks.rank, ranks.local_rank, ranks.world_size, device)
    ctx = TrainContext(
        job.config, rank.strategy, ranks.rank, ranks.local_rank, ranks.world_size, device,
        send=rank.link.send,
        checkpoint_store=checkpoints if checkpoints is not None else checkpoint_store(job.checkpoint_root,
                                                                                      job.config.keep_checkpoints),
        pulse=rank.pulse,
        data=job.data,
        params=job.params,
        lr_scale=job.lr_scale,
        preemption=_preemption_notice(job, ranks.world_size, preemption),
        outputs_root=outputs_root(job.checkpoint_root, job.config.data_dir) if job.checkpoint_root else None,
    )
    # Existing code runs unchanged: its own init/destroy_process_group adopt the run's group, and
    # Hugging Face / Ray Train metrics reach the run (dtrain_magic/integrations). Before the load:
    # names the cell imported (init_process_group, ray.train.report) resolve to the adapted ones.
    integrations.install(job.config, ctx, job.config.backend)
    return ctx


def _preemption_notice(job: WorkerJob, world_size: int, backend: tuple | None) -> Any:
    """This rank's preemption notice (`preempt.PreemptionNotice`) where the backend acts on one (the job says: the
    worker's registry may not know a backend registered in the notebook): a SIGTERM, or ``backend``'s own (poll,
    words)."""
    from .preempt import install

    if backend is None:
        return install(job.config, world_size, job.preemption_notice)
    return install(job.config, world_size, job.preemption_notice, *backend)


def _call(rank: _Rank, ctx: Any) -> Any:
    """Load the user's function and call it: ``fn(ctx)`` or ``fn()``."""
    payload = rank.job.payload
    fn = payload.load()
    if payload.argv is not None:  # the command line's arguments after --, as torchrun gives a script its own
        sys.argv = list(payload.argv)
    rank.link.send(Status(rank.ranks.rank, "running", ""))
    value = fn(ctx) if payload.takes_ctx else fn()
    sys.stdout.flush()
    sys.stderr.flush()
    return value


def _send_result(rank: _Rank, value: Any, outputs: str = "") -> None:
    try:
        data = cloudpickle.dumps(value)
    except Exception as exc:
        raise TypeError(
            f"the function's return value ({type(value).__name__}) cannot be pickled to send it back: {exc}. "
            "Return plain Python data (lists, dicts, numbers) or tensors"
        ) from None
    _close_pulse(rank)  # every logged value reaches the notebook before the result does
    rank.link.send(Result(rank.ranks.rank, data, outputs))
    rank.link.send(Status(rank.ranks.rank, "done", ""))


def _stopped(rank: _Rank, device: Any, step: int) -> None:
    """The rank stopped after ``step`` as the notebook asked (`channel.StopAt`): its last values, then `Stopped`;
    the ranks leave together, as after a result (each stopped after the same step, so each is at this barrier)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    _close_pulse(rank)
    rank.link.send(Stopped(rank.ranks.rank, step))
    rank.link.send(Status(rank.ranks.rank, "stopped", f"after step {step}"))
    if rank.owns_group:
        try:
            barrier(device)
        except Exception as exc:  # a peer that did not stop here (the notebook stops this worker): it is said
            log_dropped(__name__, "_stopped", exc)
    return None


def _report_failure(rank: _Rank, exc: BaseException) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception as flush_error:  # (not `exc`: that would unbind the exception being reported)
            log_dropped(__name__, "_report_failure", flush_error)
    _close_pulse(rank)
    number = rank.ranks.rank
    rank.link.send(Error(number, summary(exc), short_traceback(exc, rank.job.payload.labels), time.time()))
    rank.link.send(Status(number, "failed", summary(exc)))


def _close_pulse(rank: _Rank) -> None:
    pulse, rank.pulse = rank.pulse, None
    if pulse is not None:
        try:
            pulse.close()
        except Exception as exc:  # its last send, to a notebook that may be gone
            log_dropped(__name__, "_close_pulse", exc)


def _teardown(rank: _Rank) -> None:
    """Whatever happened: the process's own streams back, integrations out, the strategy and the group we
    joined torn down, the channel closed."""
    import torch.distributed as dist

    sys.stdout, sys.stderr = rank.streams
    _close_pulse(rank)
    if rank.stacks is not None:
        rank.stacks.remove()
    integrations.uninstall()  # torch's own destroy_process_group again, for the teardown below
    if rank.strategy is not None:
        try:
            rank.strategy.teardown()
        except Exception as exc:  # a strategy's teardown may raise anything: the rest still tears down
            log_dropped(__name__, "_teardown", exc)
    if rank.owns_group and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # peers gone: any error here; the process ends anyway
            log_dropped(__name__, "_teardown", exc)
    rank.link.close()


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:
        pass


def preload(strategies: tuple[str, ...] = ()) -> None:
    """Import what a worker needs before its job comes, so the job does not pay it: torch, torch.distributed,
    this package's worker side, DDP's first-use imports (torch._dynamo, sympy: about 1 s on 2 cores) and the
    modules of ``strategies`` (none given: the default one). Imports only: no tensor op (a fork server forks
    after this: OpenMP's thread pool must not exist yet), no process group. Not DeepSpeed itself: imported inside
    the run, its logger writes to the run's channel (imported before, it would write to the process's own stdout)."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    from .._compat import torch as torch_compat
    from ..registry import STRATEGIES
    from ..strategies import get_strategy
    from . import context  # noqa: F401

    torch_compat.preload_compiler()
    for name in strategies or (STRATEGIES.default,):
        try:
            get_strategy(name)
        except Exception as exc:  # an optional speed-up only: the job imports it and reports what goes wrong
            log_dropped(__name__, "preload", exc)


def run_job_file(path: str) -> int:
    """Run the pickled `WorkerJob` at ``path`` on this process's rank (from the environment); the exit code.

    What a local worker runs (forked by the local launcher's fork server, which then leaves with
    ``os._exit``: no interpreter teardown that could hang on a peer that is gone)."""
    with open(path, "rb") as handle:
        job: WorkerJob = cloudpickle.load(handle)
    from .preempt import PREEMPTED_EXIT, Preempted

    try:
        run_worker(job)
    except Preempted:  # every rank checkpointed for a preemption notice: the launcher restarts from there
        return PREEMPTED_EXIT
    except BaseException as exc:  # already reported over the channel by run_worker; the exit code says it
        log_dropped(__name__, "run_job_file", exc)
        return 1
    return 0
