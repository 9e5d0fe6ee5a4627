"""The even-split rule and the documented order of a rank's rows (`dtrain_magic.data.split`), and the per-rank
reader (`dtrain_magic.data.reader.DataBatches`) reading exactly that order from real Arrow and Parquet blocks."""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dtrain_magic.data.blocks import ArrowFileBlocks, ParquetBlocks, StagedSource, parquet_blocks
from dtrain_magic.data.kinds import _write_arrow
from dtrain_magic.data.reader import CLIENT_STATE_KEY, DataBatches, DataPositions, open_batches
from dtrain_magic.data.split import Split, block_order, epoch_rows, rank_pieces, windows

SIZES = [(1, 1), (7, 2), (10, 3), (100, 4), (101, 4), (5, 5), (999, 8)]


@pytest.mark.parametrize("rows, ranks", SIZES)
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_rank_gets_the_same_rows_and_batches_and_few_are_padded_or_dropped(rows, ranks, drop_last):
    split = Split(rows, ranks, drop_last)
    for batch in (1, 2, 3, 16):
        if split.batches(batch) == 0:
            continue
        assert split.padded < ranks and (split.padded == 0 or not drop_last)
        assert 0 <= split.dropped(batch) < ranks * batch
        read = ranks * split.batches(batch) * batch if drop_last else ranks * split.rows_per_rank
        assert read == rows + split.padded - split.dropped(batch)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_an_epoch_reads_every_row_once_up_to_the_rule(shuffle, drop_last):
    block_rows = [5, 13, 1, 40, 7, 22]  # uneven blocks, as row groups are
    rows, batch = sum(block_rows), 4
    for ranks in (1, 2, 3, 5):
        for epoch in (0, 1):
            orders = [epoch_rows(block_rows, r, ranks, epoch, 7, shuffle, drop_last, batch, 10) for r in range(ranks)]
            split = Split(rows, ranks, drop_last)
            assert {len(o) for o in orders} == {split.batches(batch) * batch if drop_last else split.rows_per_rank}
            seen = np.concatenate(orders)
            counts = np.bincount(seen, minlength=rows)
            if drop_last:  # each row at most once, fewer than ranks x batch left out
                assert counts.max() <= 1 and rows - counts.sum() < ranks * batch
            else:  # each row once, fewer than ranks read twice (the stream's first rows: padding)
                assert counts.min() == 1 and counts.sum() - rows == split.padded < ranks


def test_the_order_depends_on_seed_and_epoch_only_and_shuffles_across_blocks():
    block_rows = [50] * 8
    first = epoch_rows(block_rows, 0, 2, 0, 1, True, False, 8, 64)
    assert np.array_equal(first, epoch_rows(block_rows, 0, 2, 0, 1, True, False, 8, 64))  # same seed, same order
    assert not np.array_equal(first, epoch_rows(block_rows, 0, 2, 1, 1, True, False, 8, 64))  # next epoch: another
    assert not np.array_equal(first, epoch_rows(block_rows, 0, 2, 0, 2, True, False, 8, 64))  # another seed
    # a window of 64+ rows mixes two blocks of 50: the first batch holds rows of both
    assert len({int(row) // 50 for row in first[:64]}) == 2
    unshuffled = epoch_rows(block_rows, 1, 2, 0, 1, False, False, 8, 64)
    assert np.array_equal(unshuffled, np.arange(200, 400))  # without shuffle: rank 1 reads the second half in order


def test_pieces_follow_the_block_order_and_wrap_for_padding():
    order = block_order(3, 0, 0, False)
    assert order == [0, 1, 2] and sorted(block_order(3, 0, 0, True)) == [0, 1, 2]
    first = rank_pieces([4, 4, 3], order, 0, Split(11, 2))  # rows 0..5 of 11: 0-3 | 4,5
    assert [(p.block, p.start, p.stop) for p in first] == [(0, 0, 4), (1, 0, 2)]
    last = rank_pieces([4, 4, 3], order, 1, Split(11, 2))  # rows 6..11 of 11: 6,7 | 8,9,10 | then row 0 again
    assert [(p.block, p.start, p.stop) for p in last] == [(1, 2, 4), (2, 0, 3), (0, 0, 1)]
    assert [[p.rows for p in w] for w in windows(last, 3)] == [[2, 3], [1]]


# -- the reader reads the documented order ----------------------------------------------------------------

def _table(rows: int) -> pa.Table:
    ids = np.arange(rows, dtype=np.int64)
    image = np.stack([ids * 10 + k for k in range(6)], axis=1).astype(np.float32).reshape(rows, 2, 3)
    from dtrain_magic.data.columns import table_from_arrays

    table = table_from_arrays({"id": ids, "vec": np.stack([ids, -ids], 1).astype(np.float32), "image": image,
                               "flag": ids % 2 == 0})
    # a variable-size list column whose rows have one length (what Spark writes for an array column)
    return table.append_column("lst", pa.array([[float(i), 0.5] for i in ids], type=pa.list_(pa.float32())))


@pytest.fixture(params=["parquet", "arrow"])
def source(request, tmp_path) -> StagedSource:
    table = _table(203)
    if request.param == "parquet":
        for i, (start, stop) in enumerate([(0, 100), (100, 203)]):  # two files, row groups of 17 rows
            pq.write_table(table.slice(start, stop - start), tmp_path / f"part-{i}.parquet", row_group_size=17)
        blocks, schema = parquet_blocks(sorted(str(p) for p in tmp_path.glob("*.parquet")), "test")
    else:
        path = str(tmp_path / "data.arrow")
        _write_arrow(table, path, 23)
        blocks, schema = ArrowFileBlocks(path, tuple([23] * 8 + [19])), table.schema
    return StagedSource("train", "test", table.num_rows, schema, blocks, tuple(schema.names))


@pytest.mark.parametrize("shuffle, drop_last, ranks, batch", [(False, False, 2, 16), (True, False, 3, 10),
                                                              (True, True, 2, 32), (False, True, 4, 7)])
def test_the_reader_yields_the_documented_order_as_tensors(source, shuffle, drop_last, ranks, batch):
    for rank, epoch in itertools.product(range(ranks), (0, 3)):
        reader = DataBatches(source, rank, ranks, batch, shuffle=shuffle, seed=5, drop_last=drop_last,
                             shuffle_window=40)
        reader.set_epoch(epoch)
        batches = list(reader)
        assert len(batches) == len(reader)
        expected = epoch_rows(source.blocks.block_rows, rank, ranks, epoch, 5, shuffle, drop_last, batch, 40)
        ids = torch.cat([b["id"] for b in batches])
        assert ids.tolist() == expected.tolist()
        assert all(len(b["id"]) == batch for b in batches[:-1])
        first = batches[0]
        assert first["vec"].shape == (len(first["id"]), 2) and first["vec"].dtype == torch.float32
        assert torch.equal(first["vec"][:, 1], -first["id"].float())
        assert first["image"].shape == (len(first["id"]), 2, 3)  # an N-D column keeps its per-row shape
        assert torch.equal(first["image"][:, 1, 2], (first["id"] * 10 + 5).float())
        assert first["flag"].dtype == torch.bool and torch.equal(first["flag"], first["id"] % 2 == 0)
        for each in batches:  # lists sliced at pieces' edges and joined across windows keep their rows
            assert torch.equal(each["lst"][:, 0], each["id"].float()) and each["lst"].shape == (len(each["id"]), 2)
        first["vec"].add_(1)  # batches are the caller's own memory (never a read-only memory-mapped page)


def test_passes_move_through_epochs_and_a_restored_position_resumes_mid_epoch(source):
    reader = DataBatches(source, 0, 2, 8, shuffle=True, seed=1, shuffle_window=30)
    epoch0 = [b["id"].tolist() for b in reader]
    epoch1 = [b["id"].tolist() for b in reader]  # no set_epoch: the next pass is the next epoch
    assert epoch0 != epoch1 and reader.state()["epoch"] == 2 and reader.state()["batch"] == 0
    again = DataBatches(source, 0, 2, 8, shuffle=True, seed=1, shuffle_window=30)
    positions = DataPositions()
    positions.add("train", again)
    for _, _ in zip(range(5), again, strict=False):  # 5 batches of epoch 0, then "save a checkpoint"
        pass
    saved = positions.client_state({"epoch": 0})
    assert saved[CLIENT_STATE_KEY] == {"train": {"epoch": 0, "batch": 5, "samples": 2 * 5 * 8, "ranks": 2,
                                                 "batch_size": 8, "window": 30, "world": 2}}
    restarted = DataPositions()
    assert restarted.restore(dict(saved)) == {"epoch": 0}  # the user's own state comes back without ours
    fresh = restarted.add("train", DataBatches(source, 0, 2, 8, shuffle=True, seed=1, shuffle_window=30))
    fresh.set_epoch(0)  # the loop sets the restored epoch: the position is kept
    assert [b["id"].tolist() for b in fresh] == epoch0[5:]
    assert [b["id"].tolist() for b in fresh] == epoch1


def test_bad_arguments_name_the_source(source):
    with pytest.raises(ValueError, match="no data source of that name; its sources: train"):
        open_batches([source], "val", 0, 2, batch_size=4)
    with pytest.raises(ValueError, match="no column 'nope'; the source has id, vec, image, flag, lst"):
        open_batches([source], "train", 0, 2, batch_size=4, columns=["id", "nope"])
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        open_batches([source], "train", 0, 2, batch_size=0)
    with pytest.raises(ValueError, match="fewer than one batch"):
        open_batches([source], "train", 0, 2, batch_size=500, drop_last=True)
    only = open_batches([source], "train", 0, 2, batch_size=4, columns=["id"], collate_fn=lambda b: b["id"] * 2)
    assert torch.equal(next(iter(only)), torch.tensor([0, 2, 4, 6]))


def test_lists_of_unequal_lengths_and_nulls_are_named(tmp_path):
    table = pa.table({"v": pa.array([[1.0, 2.0], [3.0]]), "n": pa.array([1.0, None])})
    path = str(tmp_path / "t.arrow")
    _write_arrow(table, path, 2)
    source = StagedSource("s", "test", 2, table.schema, ArrowFileBlocks(path, (2,)), ("v",))
    with pytest.raises(ValueError, match="lists of different lengths"):
        list(DataBatches(source, 0, 1, 2))
    source = StagedSource("s", "test", 2, table.schema, ArrowFileBlocks(path, (2,)), ("n",))
    with pytest.raises(ValueError, match="column 'n' has 1 missing value"):
        list(DataBatches(source, 0, 1, 2))
    assert ParquetBlocks((), (), ()).rows == 0
