"""What the ``--data`` tests share: the function that reads sources with ``ctx.data`` and returns what each rank
saw, and the exactly-once check (gathered row ids == the source's ids, up to the even-split rule)."""

from __future__ import annotations

import collections
import os

import numpy as np

from dtrain_magic.data.split import Split, epoch_rows

EPOCHS = 2

# Every rank returns, per source: the ids it read in each epoch (in order), the batches per epoch, the blocks'
# rows and the shuffle window (so the test can rebuild the documented order), and its data-parallel rank.
READ_CELL = """%%distribute --backend {backend} -n {n} --seed 3 --no-ui {flags}
import torch
SOURCES = {sources!r}   # name -> ctx.data options

def train(ctx):
    out = {{}}
    for name, options in SOURCES.items():
        loader = ctx.data(name, **options)
        epochs = []
        for epoch in range({epochs}):
            loader.set_epoch(epoch)
            # the "id" column (a single array or tensor: its one column, named after its variable)
            epochs.append(torch.cat([batch.get("id", next(iter(batch.values()))) for batch in loader]).tolist())
        blocks = getattr(getattr(loader, "source", None), "blocks", None)
        out[name] = dict(epochs=epochs, batches=len(loader), block_rows=list(getattr(blocks, "block_rows", ())),
                         window=loader.shuffle_window, columns=sorted(next(iter(loader)).keys()))
    return {{"rank": ctx.data_parallel_rank, "sources": out}}
"""


def read_cell(backend: str, sources: dict, n: int = 2, flags: str = "", epochs: int = EPOCHS) -> str:
    return READ_CELL.format(backend=backend, n=n, flags=flags, sources=sources, epochs=epochs)


def assert_exactly_once(values: list, name: str, ids: list[int], drop_last: bool = False, batch_size: int = 1,
                        ranks: int = 2) -> None:
    """Each epoch, the ids every rank read, gathered, are the source's ids: each once, except the rule's padding
    (``drop_last=False``: fewer than ``ranks`` rows read twice) or drop (``drop_last=True``: fewer than
    ``ranks x batch_size`` rows left out, none read twice); every rank read the same number of rows."""
    split = Split(len(ids), ranks, drop_last)
    per_rank = [value["sources"][name] for value in values]
    assert len({each["batches"] for each in per_rank}) == 1, "ranks got different numbers of batches"
    for epoch in range(len(per_rank[0]["epochs"])):
        seen = [row for each in per_rank for row in each["epochs"][epoch]]
        assert len({len(each["epochs"][epoch]) for each in per_rank}) == 1, "ranks read different numbers of rows"
        counts = collections.Counter(seen)
        assert set(counts) <= set(ids), f"{name}, epoch {epoch}: ids that are not the source's"
        if drop_last:
            assert max(counts.values()) == 1 and 0 <= len(ids) - len(seen) < ranks * batch_size, (name, epoch)
        else:
            assert set(counts) == set(ids), f"{name}, epoch {epoch}: rows never read"
            assert sum(counts.values()) - len(ids) == split.padded < ranks, (name, epoch)


def assert_documented_order(values: list, name: str, ids_by_row: list[int], options: dict, seed: int = 3,
                            ranks: int = 2) -> None:
    """Each rank read exactly the documented order (`dtrain_magic.data.split.epoch_rows`) of a source whose natural
    row ``i`` has id ``ids_by_row[i]``."""
    for value in values:
        each = value["sources"][name]
        for epoch, got in enumerate(each["epochs"]):
            rows = epoch_rows(each["block_rows"], value["rank"], ranks, epoch, seed, options.get("shuffle", False),
                              options.get("drop_last", False), options["batch_size"], each["window"])
            assert got == [ids_by_row[row] for row in rows], (name, value["rank"], epoch)


# -- the way back (ctx.write, issue #39): a fixed model scores --data val; rank 1 may die after its 5th batch -------
SCORE_ROWS = 100_000
SCORE_CELL = """%%distribute --backend {backend} -n 2 --seed 0 --no-ui --data val={data} --output preds=preds {flags}
import os, torch
torch.manual_seed(0)
WEIGHTS = torch.nn.Linear(8, 2).state_dict()   # the fixed model, shipped with the function

def score(ctx):
    model = torch.nn.Linear(8, 2)
    model.load_state_dict(WEIGHTS)
    batches = 0
    with torch.no_grad():
        for batch in ctx.data("val", batch_size=5000, with_ids={with_ids}, pad=False):
            ctx.write("preds", {{"id": batch[{id_key!r}], "pred": model(batch["x"])}})
            batches += 1
            if ctx.rank == 1 and batches == 5 and {die}:
                os._exit(3)
    return batches
"""


def score_cell(backend: str, data: str = "val", flags: str = "", die: str = "False", id_column: str | None = None
               ) -> str:
    """SCORE_CELL; the ids written are the source's own ``id_column``, else its positions (``with_ids=True``)."""
    return SCORE_CELL.format(backend=backend, data=data, flags=flags, die=die, with_ids=id_column is None,
                             id_key=id_column or "row_id")


def scored_by_one_process(x: np.ndarray) -> np.ndarray:
    """SCORE_CELL's model scoring the rows ``x`` (n, 8) in this one process."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


def score_input() -> np.ndarray:
    """The `SCORE_ROWS` input rows (8 float32 features, a fixed seed); a cell gets them as ``val={"x": ...}``."""
    return np.random.default_rng(0).standard_normal((SCORE_ROWS, 8)).astype(np.float32)


def assert_scored_once(table, x: np.ndarray) -> None:
    """Every input row once (ids 0..SCORE_ROWS-1), its prediction equal to one process scoring the same rows (fp32,
    1e-6)."""
    ids = table.column("id").to_numpy()
    assert len(ids) == SCORE_ROWS and np.array_equal(np.sort(ids), np.arange(SCORE_ROWS))
    got = np.stack(table.column("pred").to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(got, scored_by_one_process(x[ids]), atol=1e-6, rtol=0)


def files_under(folder) -> list[str]:
    return [os.path.join(d, f) for d, _, names in os.walk(folder) for f in names]
