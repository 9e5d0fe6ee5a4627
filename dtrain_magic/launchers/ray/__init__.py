"""``--backend ray``: Ray Train's TorchTrainer. `driver` (the notebook's side: launch, cancel), `instance`
(which Ray, started or joined: `RayInstance`, kept on the kernel's launcher), `worker` (what each Ray Train
worker runs), `diagnostics` (failures in one line). Ray's private parts: `dtrain_magic._compat.ray`."""

from __future__ import annotations

from .diagnostics import failures_from
from .driver import RayJob, RayLauncher
from .instance import RayInstance
from .worker import RayCheckpointStore

__all__ = ["RayCheckpointStore", "RayInstance", "RayJob", "RayLauncher", "failures_from"]
