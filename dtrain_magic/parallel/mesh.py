"""The device mesh for model parallelism: (pp, dp, tp) from the world size and the degrees.

Ranks are laid out with tensor parallelism innermost (neighbouring ranks share a layer's shards: on a GPU node
they are the ones joined by the fastest links), then data parallelism, then pipeline stages outermost::

    rank = pp_index * (dp * tp) + dp_index * tp + tp_index

`ParallelDims` is pure arithmetic (the notebook's checks use the same numbers through `RunConfig`); `build_mesh`
makes torch's `DeviceMesh` in a worker whose process group is initialised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MESH_DIMS = ("pp", "dp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """How ``world_size`` processes divide into pipeline stages, model replicas and tensor-parallel shards."""

    world_size: int
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.world_size % (self.tp * self.pp):
            raise ValueError(
                f"world size {self.world_size} is not a multiple of tp {self.tp} x pp {self.pp} = {self.tp * self.pp}"
            )

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def shape(self) -> tuple[int, int, int]:
        """Mesh shape in `MESH_DIMS` order."""
        return (self.pp, self.dp, self.tp)

    @property
    def model_parallel(self) -> bool:
        return self.tp > 1 or self.pp > 1

    def coordinates(self, rank: int) -> dict[str, int]:
        """``{"pp": stage, "dp": replica, "tp": shard}`` of ``rank`` (the layout in the module docstring)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        return {"pp": rank // (self.dp * self.tp), "dp": (rank // self.tp) % self.dp, "tp": rank % self.tp}

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        return pp * self.dp * self.tp + dp * self.tp + tp

    def describe(self) -> str:
        parts = [f"{name} {size}" for name, size in zip(MESH_DIMS, self.shape, strict=True) if size > 1]
        return " x ".join(parts) if parts else "one process"


def build_mesh(device_type: str, dims: ParallelDims) -> Any:
    """torch's `DeviceMesh` of shape (pp, dp, tp) named ``pp``, ``dp``, ``tp`` (a collective: every rank calls it)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, dims.shape, mesh_dim_names=MESH_DIMS)
