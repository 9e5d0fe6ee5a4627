"""Where ``ctx.save_checkpoint()`` / ``ctx.load_checkpoint()`` put and find checkpoints by default.

Each save without a directory goes to a new numbered directory under the run's checkpoint root
(``--storage``, default ``./dtrain_runs``, then ``dtrain_<run key>``, a fresh key per run: the same place on every
backend, and where Ray Train keeps its own); a save to a directory the function names is remembered
too. ``latest()`` is the most recent complete save of either kind, which a restarted worker resumes
from. Backends with their own notion of checkpoints (Ray Train) wrap this store.
"""

from __future__ import annotations

import os
import re

_NAME = re.compile(r"^checkpoint_(\d{6})$")
_DONE = ".complete"
_LATEST = "LATEST"  # the last complete save (numbered or a directory the function named), one path


def storage_path(storage: str | None) -> str:
    """``--storage``, else ``./dtrain_runs``; local paths made absolute (workers may chdir)."""
    path = storage or os.path.join(os.getcwd(), "dtrain_runs")
    if "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def run_checkpoint_root(storage: str | None, run_key: str) -> str:
    """Where a run's numbered checkpoints go: ``<storage>/dtrain_<run key>`` (Ray Train's layout too)."""
    return os.path.join(storage_path(storage), f"dtrain_{run_key}")


class CheckpointStore:
    """Numbered checkpoint directories under ``root``; rank 0 picks the name and every rank agrees."""

    def __init__(self, root: str):
        self.root = root

    def _indices(self) -> list[int]:
        if not os.path.isdir(self.root):
            return []
        found = []
        for name in os.listdir(self.root):
            match = _NAME.match(name)
            if match and os.path.exists(os.path.join(self.root, name, _DONE)):
                found.append(int(match.group(1)))
        return sorted(found)

    def next_dir(self) -> str:
        indices = self._indices()
        name = f"checkpoint_{(indices[-1] + 1) if indices else 0:06d}"
        name = _agree(name)
        path = os.path.join(self.root, name)
        os.makedirs(self.root, mode=0o700, exist_ok=True)  # private to the user, as the run's other files
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path

    def saved(self, directory: str) -> None:
        """Mark ``directory`` complete (after every rank wrote its part), so a crash mid-save is ignored,
        and make it the latest."""
        if _rank() == 0:
            open(os.path.join(directory, _DONE), "w").close()
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            pointer = os.path.join(self.root, _LATEST)
            with open(pointer + ".tmp", "w") as handle:
                handle.write(os.path.abspath(directory))
            os.replace(pointer + ".tmp", pointer)  # atomic: a reader sees the old or the new path
        _barrier()

    def latest(self) -> str | None:
        try:
            with open(os.path.join(self.root, _LATEST)) as handle:
                pointed = handle.read().strip()
            if pointed and os.path.exists(os.path.join(pointed, _DONE)):
                return pointed
        except OSError:
            pass
        indices = self._indices()
        return os.path.join(self.root, f"checkpoint_{indices[-1]:06d}") if indices else None


def checkpoint_store(root: str | None) -> CheckpointStore | None:
    return CheckpointStore(root) if root else None


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _agree(name: str) -> str:
    """Rank 0's choice of ``name``, on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return name
    box = [name]
    dist.broadcast_object_list(box, src=0)
    return box[0]
