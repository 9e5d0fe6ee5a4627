"""The even-split rule and the order of one rank's rows in one epoch (pure; numpy only).

A source is a list of blocks (Parquet row groups, record batches of a staged Arrow file, slices of a table in
Ray's object store), each with its number of rows; a row's *natural index* is its position when the blocks
are read one after the other. For epoch ``e`` under ``--seed s`` (0 without ``--seed``), with ``D``
data-parallel ranks and batches of ``B`` rows:

1. **Block order**: with ``shuffle=True`` the blocks are permuted (``numpy.random.default_rng([s, e])``), else
   kept in order. Reading them in that order gives the epoch's *stream* of ``N`` rows.
2. **Even split**: each rank gets ``L`` consecutive rows of the stream, rank ``r`` those at positions
   ``r·L .. r·L+L-1``: ``L = ceil(N / D)`` (``drop_last=False``; the last rank's range wraps around to the
   stream's first ``D·L - N < D`` rows, read a second time: padding) or ``L = floor(N / D)`` (``drop_last=True``;
   the last ``N - D·L < D`` rows of the stream are left out). Every rank has the same number of rows, so the
   same number of batches: no rank ever waits in a collective for a peer that ran out.
3. **Shuffle windows** (``shuffle=True``): the rank's range is read in *windows*, consecutive pieces of blocks
   of at least ``window`` rows each; the rows of window ``w`` are permuted (``default_rng([s, e, r, w])``).
4. **Batches**: consecutive ``B`` rows of that order: ``ceil(L / B)`` batches (the last one, of ``L mod B`` rows,
   has the same size on every rank), or ``floor(L / B)`` with ``drop_last=True`` (``L mod B`` rows left out per
   rank: fewer than ``D·B`` rows of the epoch in all, a different set each epoch when shuffled).

`epoch_rows` gives the natural indices of a rank's epoch in batch order: the documented order, which the
reader (`dtrain_magic.data.reader`) produces and a one-process reference can rebuild.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Split:
    """The even-split rule for ``rows`` rows over ``ranks`` data-parallel ranks."""

    rows: int
    ranks: int
    drop_last: bool = False

    @property
    def rows_per_rank(self) -> int:
        """``L``: ``ceil(N / D)``, or ``floor(N / D)`` with ``drop_last``."""
        return -(-self.rows // self.ranks) if not self.drop_last else self.rows // self.ranks

    @property
    def padded(self) -> int:
        """Rows read twice per epoch so every rank has ``L`` (``drop_last=False``): fewer than the ranks."""
        return max(0, self.ranks * self.rows_per_rank - self.rows)

    def batches(self, batch_size: int) -> int:
        """Batches per rank per epoch, the same on every rank."""
        per_rank = self.rows_per_rank
        return per_rank // batch_size if self.drop_last else -(-per_rank // batch_size)

    def dropped(self, batch_size: int) -> int:
        """Rows of the epoch no rank reads (``drop_last=True``): fewer than ``ranks x batch_size``."""
        return self.rows - self.ranks * self.batches(batch_size) * batch_size if self.drop_last else 0


@dataclass(frozen=True)
class Piece:
    """Rows ``start .. stop-1`` of block ``block``."""

    block: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


def block_order(blocks: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The order the blocks are read in this epoch (step 1)."""
    if not shuffle:
        return list(range(blocks))
    return [int(b) for b in np.random.default_rng([seed, epoch]).permutation(blocks)]


def rank_pieces(block_rows: Sequence[int], order: Sequence[int], rank: int, split: Split) -> list[Piece]:
    """The pieces of blocks that make up ``rank``'s range of the stream, in stream order (step 2)."""
    length = split.rows_per_rank
    begin = rank * length
    pieces: list[Piece] = []
    wanted = [(begin, min(begin + length, split.rows))]
    if begin + length > split.rows:  # padding: wrap around to the stream's first rows
        wanted.append((0, begin + length - split.rows))
    for low, high in wanted:
        position = 0
        for block in order:
            count = block_rows[block]
            start, stop = max(low, position), min(high, position + count)
            if start < stop:
                pieces.append(Piece(block, start - position, stop - position))
            position += count
            if position >= high:
                break
    return pieces


def windows(pieces: Sequence[Piece], window: int) -> list[list[Piece]]:
    """Consecutive pieces grouped into shuffle windows of at least ``window`` rows (the last may be smaller)."""
    groups: list[list[Piece]] = []
    current: list[Piece] = []
    rows = 0
    for piece in pieces:
        current.append(piece)
        rows += piece.rows
        if rows >= window:
            groups.append(current)
            current, rows = [], 0
    if current:
        groups.append(current)
    return groups


def window_permutation(rows: int, seed: int, epoch: int, rank: int, index: int) -> np.ndarray:
    """The order of a shuffle window's rows (step 3)."""
    return np.random.default_rng([seed, epoch, rank, index]).permutation(rows)


def plan_epoch(block_rows: Sequence[int], rank: int, split: Split, epoch: int, seed: int, shuffle: bool,
               window: int) -> list[list[Piece]]:
    """Rank ``rank``'s epoch as the windows it reads (without ``shuffle``, one window per piece)."""
    order = block_order(len(block_rows), seed, epoch, shuffle)
    pieces = rank_pieces(block_rows, order, rank, split)
    return windows(pieces, window) if shuffle else [[piece] for piece in pieces]


def epoch_rows(block_rows: Sequence[int], rank: int, ranks: int, epoch: int, seed: int, shuffle: bool,
               drop_last: bool, batch_size: int, window: int) -> np.ndarray:
    """The natural row indices ``rank`` reads in ``epoch``, in the order its batches hold them (steps 1-4)."""
    split = Split(sum(block_rows), ranks, drop_last)
    offsets = np.concatenate([[0], np.cumsum(block_rows)]).astype(np.int64)
    parts = []
    for index, group in enumerate(plan_epoch(block_rows, rank, split, epoch, seed, shuffle, window)):
        rows = np.concatenate([np.arange(offsets[p.block] + p.start, offsets[p.block] + p.stop) for p in group])
        if shuffle:
            rows = rows[window_permutation(len(rows), seed, epoch, rank, index)]
        parts.append(rows)
    order = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return order[: split.batches(batch_size) * batch_size] if drop_last else order


# -- resuming an epoch on another number of ranks (--elastic) -------------------------------------------------
# An epoch read by D ranks in batches of B is, globally, a sequence of *rounds*: round j is rank 0's batch j, then
# rank 1's batch j, ..., rank D-1's batch j (`global_sequence`). The ranks' first b batches are exactly the first
# rounds of it, so "where the epoch is" is one number, the samples consumed globally (`samples_read`). A run
# resumed at sample S on D' ranks reads the rest of the sequence in chunks of B' rows, chunk c going to rank
# c mod D' (`resplit`): its round j is again a contiguous run of the sequence, so a global batch of B x D x A rows
# (A: gradient accumulation) is the same set of rows after the resize when B' x D' x A' = B x D x A, and each row
# left in the epoch is read exactly once. A last, partial round is shared out evenly over the ranks (or left out
# with ``drop_last``), so every rank has the same number of batches.


def global_sequence(rank_rows: Sequence[np.ndarray], batch_size: int) -> np.ndarray:
    """The epoch's rows in global order: round j = each rank's batch j in rank order (``rank_rows``: each rank's
    rows in batch order, as `epoch_rows` gives them; every rank has the same number)."""
    if not rank_rows:
        return np.zeros(0, dtype=np.int64)
    length = len(rank_rows[0])
    parts = [rows[start:start + batch_size] for start in range(0, length, batch_size) for rows in rank_rows]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def samples_read(ranks: int, batches: int, batch_size: int, rows_per_rank: int) -> int:
    """Rows of the epoch's global sequence consumed once each of ``ranks`` ranks read ``batches`` batches."""
    return ranks * min(batches * batch_size, rows_per_rank)


def resplit(rest: np.ndarray, rank: int, ranks: int, batch_size: int, drop_last: bool = False) -> list[np.ndarray]:
    """Rank ``rank``'s batches of ``rest`` (what is left of an epoch's global sequence) over ``ranks`` ranks, the
    same number on every rank: round j is ``ranks`` consecutive chunks of ``batch_size`` rows, chunk r to rank r; a
    last, partial round is shared out evenly (parts differing by one row at most), or left out with
    ``drop_last``. A last round of fewer rows than ranks gives the ranks short of one a row from the start of
    ``rest`` again (padding: fewer than ``ranks`` rows read twice, as the even split pads)."""
    span = ranks * batch_size
    full = len(rest) // span
    mine = [rest[j * span + rank * batch_size: j * span + (rank + 1) * batch_size] for j in range(full)]
    tail = rest[full * span:]
    if len(tail) and not drop_last:
        bounds = np.linspace(0, len(tail), ranks + 1).round().astype(int)
        part = tail[bounds[rank]:bounds[rank + 1]]
        mine.append(part if len(part) else rest[rank % len(rest): rank % len(rest) + 1])
    return mine
