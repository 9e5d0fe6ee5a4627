"""Where ``ctx.save_checkpoint()`` / ``ctx.load_checkpoint()`` put and find checkpoints by default.

Each save goes to a new numbered directory under the run's checkpoint root; ``latest()`` is the
highest-numbered complete one, which a restarted worker resumes from. Backends with their own notion
of checkpoints (Ray Train) wrap this store.
"""

from __future__ import annotations

import os
import re

_NAME = re.compile(r"^checkpoint_(\d{6})$")
_DONE = ".complete"


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
        os.makedirs(path, exist_ok=True)
        return path

    def saved(self, directory: str) -> None:
        """Mark ``directory`` complete (after every rank wrote its part), so a crash mid-save is ignored."""
        if _rank() == 0:
            open(os.path.join(directory, _DONE), "w").close()
        _barrier()

    def latest(self) -> str | None:
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
