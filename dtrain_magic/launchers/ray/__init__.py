"""``--backend ray``: Ray Train's TorchTrainer. `driver` (the notebook's side: launch, cancel), `instance`
(which Ray, started or joined), `worker` (what each Ray Train worker runs), `diagnostics` (failures in one line)."""

from __future__ import annotations

from .diagnostics import failures_from
from .driver import RayJob, RayLauncher
from .instance import _Embedded, _shutdown_embedded, connect
from .worker import RayCheckpointStore

__all__ = ["RayCheckpointStore", "RayJob", "RayLauncher", "_Embedded", "_shutdown_embedded", "connect", "failures_from"]
