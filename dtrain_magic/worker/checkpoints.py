"""Where ``ctx.save_checkpoint()`` / ``ctx.load_checkpoint()`` put and find checkpoints by default.

Each save without a directory goes to a new numbered directory under the run's checkpoint root
(``--storage``, default ``./dtrain_runs``, then ``dtrain_<run key>``, a fresh key per run: the same place on every
backend, and where Ray Train keeps its own); a save to a directory the function names is remembered
too. ``latest()`` is the most recent complete save of either kind, which a restarted worker resumes
from (and what ``--resume`` reads). Backends with their own notion of checkpoints (Ray Train) wrap this store.

A save is atomic: every rank writes its part, all wait in a barrier, then rank 0 writes ``.complete`` in the
directory (fsynced) and only then points ``LATEST`` at it (``os.replace``). A crash anywhere before that leaves a
directory without ``.complete``, which ``latest()`` never returns; the next save takes a new number past it (a
partial directory is never written into again, so no stale shard of a world of another size can mix in) and
removes it once a later save is complete. ``keep`` (``--keep-checkpoints K``) bounds the disk: once a save is
complete, numbered checkpoints older than the newest K are removed (never the one ``LATEST`` names).

Besides the strategy's files, each rank writes its random number generators' state (`rng_state`: torch, numpy,
python) as ``rng/rank_<r>.pt`` in the same directory, restored by `restore_rng` on load, so a resumed run draws
what the uninterrupted one would have.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

_NAME = re.compile(r"^checkpoint_(\d{6,})$")
_DONE = ".complete"
_LATEST = "LATEST"  # the last complete save (numbered or a directory the function named), one path
_saves_here = 0  # ctx.save_checkpoint calls in this process (a reused worker waits again only after a job with none)


def count_save() -> None:
    """``ctx.save_checkpoint`` saved one (`saves_here` counts them)."""
    global _saves_here
    _saves_here += 1


def saves_here() -> int:
    """How many checkpoints this process's ``ctx`` saved so far."""
    return _saves_here


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
    """Numbered checkpoint directories under ``root``; rank 0 picks the name and every rank agrees.

    ``keep``: how many complete numbered checkpoints to keep (None: all)."""

    def __init__(self, root: str, keep: int | None = None):
        self.root = root
        self.keep = keep

    def _numbered(self) -> dict[int, bool]:
        """Every numbered directory: index -> complete."""
        if not os.path.isdir(self.root):
            return {}
        found = {}
        for name in os.listdir(self.root):
            match = _NAME.match(name)
            if match:
                found[int(match.group(1))] = os.path.exists(os.path.join(self.root, name, _DONE))
        return found

    def _indices(self) -> list[int]:
        return sorted(index for index, complete in self._numbered().items() if complete)

    def _path(self, index: int) -> str:
        return os.path.join(self.root, f"checkpoint_{index:06d}")

    def next_dir(self) -> str:
        """A new numbered directory, past every existing one (a partial one from a crash too)."""
        numbered = self._numbered()
        name = f"checkpoint_{(max(numbered) + 1) if numbered else 0:06d}"
        name = _agree(name)
        path = os.path.join(self.root, name)
        os.makedirs(self.root, mode=0o700, exist_ok=True)  # private to the user, as the run's other files
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path

    def saved(self, directory: str) -> None:
        """Mark ``directory`` complete (after every rank wrote its part), so a crash mid-save is ignored,
        make it the latest, and prune to ``keep``."""
        if _rank() == 0:
            _write_synced(os.path.join(directory, _DONE), "")
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            pointer = os.path.join(self.root, _LATEST)
            _write_synced(pointer + ".tmp", os.path.abspath(directory))
            os.replace(pointer + ".tmp", pointer)  # atomic: a reader sees the old or the new path
            self.prune(os.path.abspath(directory))
        _barrier()

    def prune(self, latest: str | None = None) -> list[str]:
        """Remove numbered checkpoints beyond the newest ``keep`` complete ones, and partial ones older than the
        newest complete one (a crash's leftovers); never ``latest``. Returns the removed paths."""
        removed = []
        for index in to_prune(self._numbered(), self.keep):
            path = self._path(index)
            if latest is not None and os.path.abspath(path) == latest:
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        return removed

    def latest(self) -> str | None:
        """The most recent complete checkpoint directory (numbered or named), or None."""
        try:
            with open(os.path.join(self.root, _LATEST)) as handle:
                pointed = handle.read().strip()
            if pointed and os.path.exists(os.path.join(pointed, _DONE)):
                return pointed
        except OSError:
            pass
        indices = self._indices()
        return self._path(indices[-1]) if indices else None


def to_prune(numbered: dict[int, bool], keep: int | None) -> list[int]:
    """Which numbered checkpoints (index -> complete) go: complete ones beyond the newest ``keep`` (None: none of
    them), and partial ones older than the newest complete one (a partial newer one may be a save in progress)."""
    complete = sorted(index for index, done in numbered.items() if done)
    if not complete:
        return []
    drop = complete[:-keep] if keep else []
    drop += [index for index, done in numbered.items() if not done and index < complete[-1]]
    return sorted(drop)


def _write_synced(path: str, text: str) -> None:
    """``text`` to ``path``, flushed to the disk before returning (the marker must not outrun the data)."""
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def checkpoint_store(root: str | None, keep: int | None = None) -> CheckpointStore | None:
    """The run's store under ``root`` (None without one), keeping ``keep`` numbered checkpoints."""
    return CheckpointStore(root, keep) if root else None


def rng_state() -> dict[str, Any]:
    """This process's random number generators: torch's (CPU and, when used, CUDA), numpy's, python's."""
    import random

    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what `rng_state` saved (the parts this process has)."""
    import random

    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


def rng_path(directory: str, rank: int) -> str:
    """Where rank ``rank`` keeps its generators' state in a checkpoint directory."""
    return os.path.join(directory, "rng", f"rank_{rank}.pt")


def save_rng(directory: str, rank: int) -> None:
    """This rank's `rng_state` into the checkpoint ``directory`` (before the save is marked complete)."""
    import torch

    path = rng_path(directory, rank)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    torch.save(rng_state(), path)


def load_rng(directory: str, rank: int) -> bool:
    """Restore this rank's generators from ``directory``; False when it holds none for this rank (a checkpoint
    from before, or from a smaller world: the rank keeps its seeded state)."""
    import torch

    path = rng_path(directory, rank)
    if not os.path.exists(path):
        return False
    restore_rng(torch.load(path, weights_only=False))
    return True


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
