"""What one run's workers are handed (`WorkerJob`) and which rank each one is (`RankInfo`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from ..channel import ChannelAddress
from ..config import RunConfig
from ..payload import Payload


@dataclass(frozen=True)
class WorkerJob:
    """Everything one run's workers need; pickled once and handed to every worker by the launcher."""

    payload: Payload
    config: RunConfig
    channel: ChannelAddress
    run_id: str | None = None
    checkpoint_root: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    data: tuple = ()  # the run's data sources as the ranks read them (`dtrain_magic.data.blocks.StagedSource`)
    # The strategy class, pickled in the notebook (`payload.dumps_by_value`): one registered there from the user's
    # own code (`registry.STRATEGIES.register`) reaches workers whose registry never heard of it.
    strategy: bytes | None = None
    # A sweep trial's hyperparameters (`ctx.params`): the same mapping on every rank of the run.
    params: dict[str, Any] = field(default_factory=dict)
    # --elastic: the learning-rate factor of this world size when a resize could not keep the global batch exactly
    lr_scale: float = 1.0
    # Whether the backend acts on a preemption notice (`Backend.preemption_notice`): decided in the notebook, whose
    # registry knows every backend (a worker's may not: one registered from the user's own code)
    preemption_notice: bool = False
    # Workers launched ahead (a standby's) wait for the next job once this one returned, instead of ending: a sweep's
    # trials reuse them (`launchers.waiting.serve_jobs`). Not after a job that saved a checkpoint (Ray Train's run
    # would hand it to the next job as its own).
    reuse_workers: bool = False

    def strategy_class(self) -> type:
        if self.strategy is not None:
            return cloudpickle.loads(self.strategy)
        from ..strategies import get_strategy

        return get_strategy(self.config.strategy)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int = 1


def rank_from_env() -> RankInfo:
    """Ranks as set by torchrun, TorchDistributor or the local launcher."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return RankInfo(
        rank=int(os.environ.get("RANK", "0")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        world_size=world,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
    )
