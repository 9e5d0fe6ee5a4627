"""``ctx.data(name, batch_size, ...)``: this rank's batches of one source, in the documented order.

`DataBatches` reads the blocks of a `StagedSource` (`dtrain_magic.data.blocks`) in the order
`dtrain_magic.data.split` documents, one shuffle window ahead in a background thread (decoding Parquet releases
the GIL, so the next window is read while the current one trains), and yields each batch as a dict of tensors
(or what ``collate_fn`` makes of it). `RayShardBatches` reads a Ray Dataset through Ray Train's own shard.
Both remember where they are (`state`), so ``ctx.save_checkpoint`` / ``ctx.load_checkpoint`` carry the data
position across a restart (`DataPositions`). A `DataBatches` position is also the samples consumed globally in the
epoch's global order (`dtrain_magic.data.split`, "resuming an epoch on another number of ranks"): restored on
another number of ranks (``--elastic``), the rest of that epoch is re-split from there, each row read once, and
later epochs follow the same global order, so each optimizer step sees the rows it would have without the resize.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from .blocks import StagedSource, TrainerDataset
from .columns import row_bytes, to_numpy
from .split import (
    Split,
    block_order,
    epoch_rows,
    global_sequence,
    plan_epoch,
    resplit,
    samples_read,
    window_permutation,
)

# Rows of a shuffle window by default: about this many bytes of tensors, and never fewer than 16 batches.
DEFAULT_WINDOW_BYTES = 64 << 20
_NATURAL = "\0natural"  # a window's natural row indices while pad=False leaves the padding out (never in a batch)
CLIENT_STATE_KEY = "dtrain_magic.data"  # where ctx.save_checkpoint keeps the data positions in client_state
Progress = Callable[[int, int, int], None]  # (epoch, batches done, batches per epoch)


def _check_arguments(source: StagedSource, batch_size: Any, columns: Sequence[str] | None) -> tuple[str, ...]:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"ctx.data({source.name!r}): batch_size must be an integer >= 1, got {batch_size!r}")
    available = source.column_names
    if columns is None:
        return tuple(available)
    if isinstance(columns, str):
        columns = [columns]
    unknown = [c for c in columns if c not in available]
    if unknown:
        raise ValueError(f"ctx.data({source.name!r}, columns=...): no column {unknown[0]!r}; the source has "
                         f"{', '.join(available)}")
    return tuple(columns)


class DataBatches:
    """This rank's batches of one source: iterate it once per epoch (``set_epoch(e)`` first to choose the epoch;
    without it each full pass moves to the next). ``len()`` is the batches per epoch, the same on every rank."""

    _layout: tuple[int, int, int] | None = None  # --elastic: see `restore`

    def __init__(self, source: StagedSource, rank: int, ranks: int, batch_size: int, *, shuffle: bool = False,
                 seed: int = 0, drop_last: bool = False, columns: Sequence[str] | None = None,
                 collate_fn: Callable[[dict], Any] | None = None, device: Any = None,
                 shuffle_window: int | None = None, progress: Progress | None = None, with_ids: bool | str = False,
                 pad: bool = True):
        self.source, self.rank, self.ranks = source, rank, ranks
        self.columns = _check_arguments(source, batch_size, columns)
        self.id_key = _id_key(source, with_ids)
        self.pad = bool(pad)  # False: the even split's padding rows (read twice) are left out of the batches
        self.batch_size, self.shuffle, self.seed, self.drop_last = batch_size, bool(shuffle), seed, bool(drop_last)
        self.collate_fn, self.device, self._progress = collate_fn, device, progress
        self.split = Split(source.rows, ranks, self.drop_last)
        if len(self) == 0:
            raise ValueError(
                f"ctx.data({source.name!r}, batch_size={batch_size}, drop_last=True): each of the {ranks} rank(s) "
                f"gets {self.split.rows_per_rank} row(s) of the {source.rows}, fewer than one batch; use a smaller "
                "batch_size, or drop_last=False")
        fields = [source.schema.field(name) for name in self.columns]
        self._fields = fields
        if shuffle_window is None:
            shuffle_window = max(16 * batch_size, DEFAULT_WINDOW_BYTES // row_bytes(pa.schema(fields)))
        self.shuffle_window = int(shuffle_window)
        self.epoch = 0
        self.position = (0, 0)  # (epoch, batches yielded in it)
        self._resume: tuple[int, int] | None = None
        # --elastic: the layout (ranks, batch size, shuffle window) whose global sequence every epoch follows once the
        # run was resized (None: this reader's own), and the samples of the resumed epoch read before the resize
        self._layout: tuple[int, int, int] | None = None
        self._start: tuple[int, int] = (0, 0)  # (epoch, samples of it read before this reader took over)

    def __len__(self) -> int:
        if self._layout is not None:
            return len(self._layout_batches(self.epoch, 0))
        return self.split.batches(self.batch_size)

    @property
    def rows_per_epoch(self) -> int:
        """Rows this rank reads per epoch (``len(self)`` batches)."""
        return min(self.split.rows_per_rank, len(self) * self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next pass reads (its order under ``shuffle``). A position restored by
        ``ctx.load_checkpoint`` for this same epoch is kept: the pass resumes there."""
        self.epoch = int(epoch)
        if self._resume is not None and self._resume[0] != self.epoch:
            self._resume = None
        if self._layout is not None:
            self.position = (self.epoch, self._skipped(self.epoch))
            return
        self.position = (self.epoch, self._resume[1] if self._resume else 0)

    def state(self) -> dict[str, int]:
        """Where this reader is: the epoch, the batches of it this rank yielded, and the samples consumed globally
        in the epoch's global sequence with the layout (ranks, batch size, shuffle window) that defines it."""
        epoch, batch = self.position
        if self._layout is not None:  # a resized run: the sequence of the layout the run was first read with
            ranks, size, window = self._layout
            before = self._start[1] if self._start[0] == epoch else 0
            read = (batch - self._skipped(epoch)) * self.ranks * self.batch_size
            left = len(self._sequence(epoch)) - before
            return {"epoch": epoch, "batch": batch, "samples": before + min(read, left), "ranks": ranks,
                    "batch_size": size, "window": window, "world": self.ranks}
        samples = samples_read(self.ranks, batch, self.batch_size, self.rows_per_epoch)
        return {"epoch": epoch, "batch": batch, "samples": samples, "ranks": self.ranks,
                "batch_size": self.batch_size, "window": self.shuffle_window, "world": self.ranks}

    def restore(self, state: Mapping[str, int]) -> None:
        """Resume at ``state`` (from `state`): the next pass reads that epoch from that batch on. Saved by another
        number of ranks (or another batch size), this reader follows the layout it was saved with from then on
        (`split.resplit`): the rest of the epoch from its global sample position, later epochs whole, so each
        global batch holds the rows it held before the resize."""
        epoch, batch = int(state.get("epoch", 0)), int(state.get("batch", 0))
        layout = (int(state.get("ranks", self.ranks)), int(state.get("batch_size", self.batch_size)),
                  int(state.get("window", self.shuffle_window)))
        saver = int(state.get("world", layout[0]))  # the ranks that read it (a resized run's may differ)
        if layout != (self.ranks, self.batch_size, self.shuffle_window) or saver != self.ranks:
            self._layout = layout
            self._sequences: dict[int, np.ndarray] = {}
            self._start = (epoch, int(state.get("samples", 0)))
            self._resume = None
            self.epoch, self.position = epoch, (epoch, self._skipped(epoch))
            return
        self._layout = None
        if batch >= len(self):
            epoch, batch = epoch + 1, 0
        self.epoch, self.position = epoch, (epoch, batch)
        self._resume = (epoch, batch) if batch else None

    def _sequence(self, epoch: int) -> np.ndarray:
        """The epoch's global sequence under the run's layout (`split.global_sequence`), natural row indices."""
        if epoch not in self._sequences:
            ranks, size, window = self._layout  # type: ignore[misc]
            block_rows = self.source.blocks.block_rows
            rows = [epoch_rows(block_rows, r, ranks, epoch, self.seed, self.shuffle, self.drop_last, size, window)
                    for r in range(ranks)]
            self._sequences = {epoch: global_sequence(rows, size)}  # one epoch kept
        return self._sequences[epoch]

    def _layout_batches(self, epoch: int, start: int) -> list[np.ndarray]:
        """This rank's batches of the epoch's global sequence from sample ``start`` on (`split.resplit`)."""
        return resplit(self._sequence(epoch)[start:], self.rank, self.ranks, self.batch_size, self.drop_last)

    def _skipped(self, epoch: int) -> int:
        """Batches of ``epoch`` counted as read when this reader took over mid-epoch (so a full epoch is len())."""
        if self._start[0] != epoch or not self._start[1]:
            return 0
        return max(0, len(self._layout_batches(epoch, 0)) - len(self._layout_batches(epoch, self._start[1])))

    def __iter__(self) -> Iterator[Any]:
        if self._layout is not None:
            yield from self._iter_layout()
            return
        epoch = self.epoch
        skip = self._resume[1] if self._resume and self._resume[0] == epoch else 0
        self._resume = None
        self.position = (epoch, skip)
        done = skip
        for batch in self._batches(epoch, skip):
            done += 1
            self.position = (epoch, done)
            if self._progress is not None:
                self._progress(epoch, done, len(self))
            yield batch
        while done < len(self):  # pad=False: a rank whose last rows were padding still has len() batches, empty
            done += 1
            self.position = (epoch, done)
            yield self._finish(self._empty())
        self.epoch = epoch + 1
        self.position = (self.epoch, 0)

    def _iter_layout(self) -> Iterator[Any]:
        """A resized run's epoch: this rank's chunks of the layout's global sequence (from where the resize left it),
        read row by row from the blocks."""
        epoch = self.epoch
        start = self._start[1] if self._start[0] == epoch else 0
        done = self._skipped(epoch)
        total = len(self)
        cache: dict[int, dict[str, np.ndarray]] = {}
        for indices in self._layout_batches(epoch, start):
            arrays = self._read_rows(indices, cache)
            done += 1
            self.position = (epoch, done)
            if self._progress is not None:
                self._progress(epoch, done, total)
            yield self._finish(arrays)
        self.epoch = epoch + 1
        self.position = (self.epoch, 0)

    def _read_rows(self, indices: np.ndarray, cache: dict[int, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The rows at natural ``indices``, in that order (blocks read once each, the last 4 kept)."""
        offsets = np.asarray(self.source.blocks.block_offsets, dtype=np.int64)  # each block's first natural index
        owners = np.searchsorted(offsets, indices, side="right") - 1
        parts: dict[str, list] = {f.name: [] for f in self._fields}
        order = []
        for block in dict.fromkeys(owners.tolist()):
            if block not in cache:
                if len(cache) >= 4:
                    cache.pop(next(iter(cache)))
                table = self.source.blocks.read(block, self.columns)
                cache[block] = {f.name: to_numpy(table.column(f.name), f) for f in self._fields}
            where = np.nonzero(owners == block)[0]
            order.append(where)
            for name, values in cache[block].items():
                parts[name].append(np.take(values, indices[where] - offsets[block], axis=0))
        inverse = np.argsort(np.concatenate(order), kind="stable")
        arrays = {name: np.concatenate(chunks)[inverse] for name, chunks in parts.items()}
        if self.id_key is not None:  # ctx.data(..., with_ids=...): the natural indices are the ids
            arrays[self.id_key] = np.asarray(indices, dtype=np.int64)
        return arrays

    # -- reading -----------------------------------------------------------------------------------
    def _batches(self, epoch: int, skip: int) -> Iterator[Any]:
        size = self.batch_size
        total = len(self) * size if self.drop_last else self.split.rows_per_rank
        skip_rows, emitted = skip * size, skip * size
        carry: dict[str, np.ndarray] | None = None
        for arrays in self._windows(epoch, skip_rows):
            rows = len(next(iter(arrays.values())))
            start = 0
            if carry is not None:
                take = min(size - _length(carry), rows)
                carry = {k: np.concatenate([carry[k], v[:take]]) for k, v in arrays.items()}
                start = take
                if _length(carry) < size:
                    continue
                yield self._finish(carry)
                emitted += size
                carry = None
            while rows - start >= size and emitted < total:
                yield self._finish({k: v[start:start + size] for k, v in arrays.items()})
                start += size
                emitted += size
            if start < rows and emitted < total:
                carry = {k: v[start:] for k, v in arrays.items()}
        if carry is not None and emitted < total and not self.drop_last:
            yield self._finish({k: v[: total - emitted] for k, v in carry.items()})

    def _windows(self, epoch: int, skip_rows: int) -> Iterator[dict[str, np.ndarray]]:
        """The rank's windows as numpy arrays (permuted under ``shuffle``), the first ``skip_rows`` rows left out
        (whole windows before them are not read at all), read one ahead in a background thread."""
        plan = plan_epoch(self.source.blocks.block_rows, self.rank, self.split, epoch, self.seed, self.shuffle,
                          self.shuffle_window)
        jobs, position = [], 0
        for index, group in enumerate(plan):
            rows = sum(piece.rows for piece in group)
            if position + rows > skip_rows:
                jobs.append((index, group, max(0, skip_rows - position)))
            position += rows
        pending = _Ahead(self._read_window, epoch, jobs[0]) if jobs else None
        for next_job in [*jobs[1:], None]:
            arrays = pending.result()
            pending = _Ahead(self._read_window, epoch, next_job) if next_job is not None else None
            yield arrays

    def _read_window(self, epoch: int, job: tuple) -> dict[str, np.ndarray]:
        index, group, drop = job
        blocks = self.source.blocks
        tables = [blocks.read(piece.block, self.columns).slice(piece.start, piece.rows) for piece in group]
        table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
        arrays = {f.name: to_numpy(table.column(f.name), f) for f in self._fields}
        unpadded = not self.pad and self._padding(epoch).size
        if self.id_key is not None or unpadded:  # each row's natural index: its position in the source
            offsets = self.source.blocks.block_offsets
            arrays[self.id_key or _NATURAL] = np.concatenate([
                np.arange(offsets[p.block] + p.start, offsets[p.block] + p.stop, dtype=np.int64) for p in group])
        if self.shuffle:
            order = window_permutation(table.num_rows, self.seed, epoch, self.rank, index)
            arrays = {k: np.take(v, order, axis=0) for k, v in arrays.items()}
        arrays = {k: v[drop:] for k, v in arrays.items()} if drop else arrays
        if unpadded:  # this rank's share wrapped around: the rows another rank reads too are left out
            keep = ~np.isin(arrays[self.id_key or _NATURAL], self._padding(epoch))
            arrays = {k: v[keep] for k, v in arrays.items()}
        arrays.pop(_NATURAL, None)
        return arrays

    def _padding(self, epoch: int) -> np.ndarray:
        """The natural indices of the rows the even split pads this rank's share with in ``epoch`` (read twice: the
        first rows of the epoch's stream), empty for a rank whose share does not wrap around."""
        length = self.split.rows_per_rank
        wrap = 0 if self.drop_last else self.rank * length + length - self.split.rows
        if wrap <= 0:
            return np.zeros(0, dtype=np.int64)
        offsets, rows = self.source.blocks.block_offsets, self.source.blocks.block_rows
        first: list[np.ndarray] = []  # fewer rows than ranks: only the first block(s) of the epoch's order
        for block in block_order(len(rows), self.seed, epoch, self.shuffle):
            first.append(np.arange(offsets[block], offsets[block] + min(rows[block], wrap), dtype=np.int64))
            wrap -= len(first[-1])
            if wrap <= 0:
                break
        return np.concatenate(first)

    def _empty(self) -> dict[str, np.ndarray]:
        """A batch of no rows, with every column's type and per-row shape."""
        table = self.source.blocks.read(0, self.columns).slice(0, 0)
        arrays = {f.name: to_numpy(table.column(f.name), f) for f in self._fields}
        if self.id_key is not None:
            arrays[self.id_key] = np.zeros(0, dtype=np.int64)
        return arrays

    def _finish(self, arrays: dict[str, np.ndarray]) -> Any:
        import torch

        batch = {}
        for name, values in arrays.items():
            if not values.flags.writeable:  # Arrow's own (or memory-mapped) memory: the batch gets its own copy
                values = values.copy()
            tensor = torch.from_numpy(values)
            batch[name] = tensor.to(self.device) if self.device is not None and tensor.device != self.device else tensor
        return self.collate_fn(batch) if self.collate_fn is not None else batch

    def __repr__(self) -> str:
        return (f"DataBatches({self.source.name!r}: {len(self)} batches of {self.batch_size} per epoch on rank "
                f"{self.rank} of {self.ranks}, shuffle={self.shuffle}, epoch {self.epoch})")


def _id_key(source: StagedSource, with_ids: bool | str) -> str | None:
    """The batch key of the row ids ``ctx.data(..., with_ids=)`` asks for (None: none); a `ValueError` for a key
    that is one of the source's columns."""
    if with_ids is False or with_ids is None:
        return None
    key = "row_id" if with_ids is True else with_ids
    if not isinstance(key, str) or not key:
        raise ValueError(f"ctx.data({source.name!r}, with_ids=...): give True (ids as batch['row_id']) or the key to "
                         f"put them under, got {with_ids!r}")
    if key in source.column_names:
        raise ValueError(f"ctx.data({source.name!r}, with_ids={with_ids!r}): the source already has a column {key!r}; "
                         "name another key for the ids (with_ids='my_key'), or read that column itself as the id")
    return key


def _length(arrays: dict[str, np.ndarray]) -> int:
    return len(next(iter(arrays.values())))


class _Ahead:
    """``read(epoch, job)`` in a daemon thread; `result` waits for it (and raises what it raised)."""

    def __init__(self, read: Callable[..., Any], epoch: int, job: Any):
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(read, epoch, job), name="dtrain-data-read",
                                        daemon=True)
        self._thread.start()

    def _run(self, read: Callable[..., Any], epoch: int, job: Any) -> None:
        try:
            self._value = read(epoch, job)
        except BaseException as exc:  # noqa: BLE001 - raised in the reading thread by result()
            self._error = exc

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class RayShardBatches:
    """A Ray Dataset's batches on ``--backend ray``: ``ray.train.get_dataset_shard(name).iter_torch_batches``, Ray
    Train having split the dataset among the ranks (``streaming_split(equal=True)``: every rank the same number
    of rows, fewer than the ranks left out). Shuffling is Ray's local shuffle buffer (``shuffle_window`` rows),
    seeded from ``--seed`` and the epoch. A restart resumes at the start of the epoch it was in."""

    def __init__(self, source: StagedSource, rank: int, ranks: int, batch_size: int, *, shuffle: bool = False,
                 seed: int = 0, drop_last: bool = False, columns: Sequence[str] | None = None,
                 collate_fn: Callable[[dict], Any] | None = None, device: Any = None,
                 shuffle_window: int | None = None, progress: Progress | None = None, with_ids: bool | str = False,
                 pad: bool = True):
        import ray.train

        if with_ids is not False and with_ids is not None:
            raise ValueError(f"ctx.data({source.name!r}, with_ids=...): a Ray Dataset on --backend ray is streamed to "
                             "the ranks by Ray Train, in no fixed order, so its rows have no position to be their id: "
                             "read an id column of the Dataset itself (columns=[..., 'id'])")
        self.source, self.rank, self.ranks = source, rank, ranks
        self.columns = _check_arguments(source, batch_size, columns)
        self.batch_size, self.shuffle, self.seed, self.drop_last = batch_size, bool(shuffle), seed, bool(drop_last)
        self.collate_fn, self.device, self._progress = collate_fn, device, progress
        self.shuffle_window = int(shuffle_window or 16 * batch_size)
        per_rank = source.rows // ranks
        self._batches = per_rank // batch_size if self.drop_last else -(-per_rank // batch_size)
        if self._batches == 0:
            raise ValueError(
                f"ctx.data({source.name!r}, batch_size={batch_size}, drop_last=True): each of the {ranks} rank(s) "
                f"gets {per_rank} row(s) of the {source.rows}, fewer than one batch; use a smaller batch_size, or "
                "drop_last=False")
        self.shard = ray.train.get_dataset_shard(source.name)
        self.epoch = 0
        self.position = (0, 0)

    def __len__(self) -> int:
        return self._batches

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self.position = (self.epoch, 0)

    def state(self) -> dict[str, int]:
        return {"epoch": self.position[0], "batch": self.position[1]}

    def restore(self, state: Mapping[str, int]) -> None:
        self.set_epoch(int(state.get("epoch", 0)))  # Ray Data cannot start mid-epoch: the epoch from its start

    def __iter__(self) -> Iterator[Any]:
        epoch = self.epoch
        options: dict[str, Any] = {"batch_size": self.batch_size, "drop_last": self.drop_last}
        if self.device is not None:
            options["device"] = self.device
        if self.shuffle:
            options["local_shuffle_buffer_size"] = self.shuffle_window
            options["local_shuffle_seed"] = int(np.random.SeedSequence([self.seed, epoch]).generate_state(1)[0])
        done = 0
        for batch in self.shard.iter_torch_batches(**options):
            if set(batch) != set(self.columns):
                batch = {name: batch[name] for name in self.columns}
            done += 1
            self.position = (epoch, done)
            if self._progress is not None:
                self._progress(epoch, done, len(self))
            yield self.collate_fn(batch) if self.collate_fn is not None else batch
        self.epoch = epoch + 1
        self.position = (self.epoch, 0)


def open_batches(sources: Sequence[StagedSource], name: str, rank: int, ranks: int, **options: Any) -> Any:
    """The reader of source ``name`` for this rank; a `KeyError`-like `ValueError` naming the run's sources."""
    found = {source.name: source for source in sources}
    if name not in found:
        known = ", ".join(found) or "none (give them with --data NAME=SOURCE)"
        raise ValueError(f"ctx.data({name!r}): this run has no data source of that name; its sources: {known}")
    source = found[name]
    cls = RayShardBatches if isinstance(source.blocks, TrainerDataset) else DataBatches
    return cls(source, rank, ranks, **options)


class DataPositions:
    """The readers ``ctx.data`` made, by name, and their positions in a checkpoint's ``client_state``."""

    def __init__(self) -> None:
        self.readers: dict[str, Any] = {}
        self._pending: dict[str, Mapping[str, int]] = {}

    def add(self, name: str, reader: Any) -> Any:
        self.readers[name] = reader
        if name in self._pending:
            reader.restore(self._pending.pop(name))
        return reader

    def client_state(self, client_state: Mapping[str, Any]) -> dict[str, Any]:
        """``client_state`` with every reader's position added (nothing added when there is no reader)."""
        if not self.readers:
            return dict(client_state)
        return {**client_state, CLIENT_STATE_KEY: {name: r.state() for name, r in self.readers.items()}}

    def restore(self, client_state: dict | None) -> dict | None:
        """Take the positions out of a restored ``client_state`` and apply them (to readers made later too)."""
        if not client_state or CLIENT_STATE_KEY not in client_state:
            return client_state
        client_state = dict(client_state)
        for name, state in client_state.pop(CLIENT_STATE_KEY).items():
            if name in self.readers:
                self.readers[name].restore(state)
            else:
                self._pending[name] = state
        return client_state


class ProgressSender:
    """Rank 0's data progress to the notebook: the first batch, every ``every_s`` seconds, and the last one."""

    def __init__(self, send: Callable[[str, int, int, int], None], name: str, every_s: float = 0.5):
        self._send, self._name, self._every_s = send, name, every_s
        self._last = 0.0

    def __call__(self, epoch: int, done: int, total: int) -> None:
        now = time.monotonic()
        if done in (1, total) or now - self._last >= self._every_s:
            self._last = now
            self._send(self._name, epoch, done, total)
