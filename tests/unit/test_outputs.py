"""``ctx.write``'s pure logic (docs/data.md, the way back): each rank's parts, the commit of exactly the parts the
last attempt sealed, the abort that leaves nothing, the errors naming the output and the column, ``--output``'s
spec, and ``ctx.data(..., with_ids=True)``'s ids."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pyarrow as pa
import pytest
import torch

from dtrain_magic.config import RunConfig
from dtrain_magic.data.blocks import ArrowFileBlocks, StagedSource
from dtrain_magic.data.outputs import STAGING, SUCCESS, OutputError, OutputWriter, abort, commit, outputs_root
from dtrain_magic.data.reader import DataBatches
from dtrain_magic.errors import ConfigError


def files_under(folder) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, names in os.walk(folder) for f in names)


def write_rank(root, rank: int, rows: range, writes: bool = True) -> str:
    writer = OutputWriter(str(root), rank, writes)
    for start in range(rows.start, rows.stop, 3):
        ids = np.arange(start, min(start + 3, rows.stop))
        writer.write("preds", {"id": torch.from_numpy(ids), "score": torch.from_numpy(ids * 0.5).float(),
                               "emb": np.stack([ids, ids]).T.astype(np.float32)})
    return writer.seal()


def test_the_sealed_parts_of_every_rank_are_committed_once_with_a_marker(tmp_path):
    root = tmp_path / "outputs"
    manifests = {0: write_rank(root, 0, range(0, 10)), 1: write_rank(root, 1, range(10, 20))}
    assert all(f.startswith(f"{STAGING}/preds/part-r0000") for f in files_under(root))  # nothing committed yet
    outputs = commit(str(root), manifests)
    preds = outputs["preds"]
    assert preds.rows == 20 and preds.path == str(root / "preds")
    assert preds.columns == (("id", "int64"), ("score", "float"), ("emb", "fixed_size_list<item: float>[2]"))
    table = preds.dataset().to_table()
    assert sorted(table.column("id").to_pylist()) == list(range(20))
    assert table.column("score").to_pylist() == [i * 0.5 for i in table.column("id").to_pylist()]
    assert sorted(os.listdir(root)) == ["preds"] and SUCCESS in os.listdir(root / "preds")  # staging gone
    assert "20 rows" in repr(preds) and len(preds.to_pandas()) == 20


def test_an_earlier_attempts_parts_are_never_committed(tmp_path):
    root = tmp_path / "outputs"
    write_rank(root, 0, range(0, 10))  # attempt 1: rank 0 sealed, rank 1 died mid-write (not sealed)
    dead = OutputWriter(str(root), 1)
    dead.write("preds", {"id": np.arange(10, 13), "score": np.zeros(3, np.float32),
                         "emb": np.zeros((3, 2), np.float32)})
    dead.abort()
    other = OutputWriter(str(root), 1)  # and an output the last attempt never writes
    other.write("scratch", {"id": np.arange(3)})
    other.seal()
    manifests = {0: write_rank(root, 0, range(0, 10)), 1: write_rank(root, 1, range(10, 20))}  # attempt 2
    outputs = commit(str(root), manifests)
    ids = outputs["preds"].dataset().to_table().column("id").to_pylist()
    assert sorted(ids) == list(range(20))  # every row once: the first attempt's files went with the staging folder
    assert len([f for f in os.listdir(root / "preds") if f.endswith(".parquet")]) == 2
    assert sorted(os.listdir(root)) == ["preds"]  # no scratch: no manifest of the last attempt listed it


def test_an_aborted_run_leaves_no_file_and_no_folder(tmp_path):
    run = tmp_path / "dtrain_abc"
    root = run / "outputs"
    write_rank(root, 0, range(0, 10))
    assert files_under(tmp_path)
    abort(str(root))
    assert not run.exists()  # the run's folder held only the outputs: it goes too
    abort(str(root))  # nothing there: nothing to do


def test_a_rank_of_a_replica_that_does_not_write_checks_its_batches_and_writes_nothing(tmp_path):
    root = tmp_path / "outputs"
    assert write_rank(root, 1, range(0, 10), writes=False) == ""
    manifests = {0: write_rank(root, 0, range(0, 10)), 1: ""}
    assert commit(str(root), manifests)["preds"].rows == 10
    silent = OutputWriter(str(root), 1, writes=False)
    with pytest.raises(OutputError, match="column 'x' is a str"):
        silent.write("preds", {"x": "no"})


@pytest.mark.parametrize("batch, why", [
    ({"id": [1, 2], "label": "cat"}, r"ctx.write\('preds'\): column 'label' is a str; give a tensor"),
    ({"id": [1, 2], "p": 0.5}, r"column 'p' is a float"),
    ({"id": [1, 2], "p": torch.tensor(0.5)}, r"column 'p' is a single value"),
    ({"id": [1, 2], "name": np.array(["a", "b"])}, r"column 'name' holds <U1 values"),
    ({"id": [1, 2], "p": [1.0]}, r"column 'p' has 1 row\(s\) but column 'id' has 2"),
    ([1, 2], r"batch must be a non-empty dict"),
    ({}, r"batch must be a non-empty dict"),
])
def test_a_value_that_is_not_rows_of_numbers_names_the_output_and_the_column(tmp_path, batch, why):
    with pytest.raises(OutputError, match=why):
        OutputWriter(str(tmp_path), 0).write("preds", batch)


def test_an_output_written_with_other_columns_or_types_names_the_column(tmp_path):
    writer = OutputWriter(str(tmp_path), 0)
    writer.write("preds", {"id": np.arange(3), "p": np.zeros(3, np.float32)})
    with pytest.raises(OutputError, match=r"ctx.write\('preds'\): column 'p' is double; earlier writes of output "
                                          r"'preds' wrote it as float"):
        writer.write("preds", {"id": np.arange(3), "p": np.zeros(3)})
    with pytest.raises(OutputError, match="column 'q' is new"):
        writer.write("preds", {"id": np.arange(3), "q": np.zeros(3, np.float32)})
    with pytest.raises(OutputError, match="column 'p' is missing"):
        writer.write("preds", {"id": np.arange(3)})
    writer.write("other", {"id": np.arange(3)})  # another output has its own columns
    with pytest.raises(OutputError, match="an output's name must be a Python identifier"):
        writer.write("my preds", {"id": np.arange(3)})


def test_a_write_after_the_run_ended_is_refused(tmp_path):
    writer = OutputWriter(str(tmp_path), 0)
    writer.write("preds", {"id": np.arange(3)})
    writer.seal()
    with pytest.raises(OutputError, match=r"ctx.write\('preds'\): the run has ended; a write must happen while"):
        writer.write("preds", {"id": np.arange(3)})


def test_ranks_that_wrote_one_output_with_other_types_commit_nothing(tmp_path):
    root = tmp_path / "outputs"
    first, second = OutputWriter(str(root), 0), OutputWriter(str(root), 1)
    first.write("preds", {"id": np.arange(3), "p": np.zeros(3, np.float32)})
    second.write("preds", {"id": np.arange(3), "p": np.zeros(3, np.float64)})
    with pytest.raises(OutputError, match="column 'p' is double; rank 0's writes of output 'preds' wrote it as float"):
        commit(str(root), {0: first.seal(), 1: second.seal()})
    assert not (root / "preds").exists()


def test_bfloat16_and_two_dimensional_values_keep_their_rows(tmp_path):
    writer = OutputWriter(str(tmp_path), 0)
    writer.write("emb", {"v": torch.ones(4, 3, dtype=torch.bfloat16), "m": np.zeros((4, 2, 2))})
    manifest = json.loads(writer.seal())["outputs"]["emb"]
    assert manifest["rows"] == 4 and manifest["columns"][0] == ["v", "fixed_size_list<item: float>[3]"]


def test_outputs_go_beside_the_checkpoints_or_under_data_dir():
    assert outputs_root("/runs/dtrain_k") == "/runs/dtrain_k/outputs"
    assert outputs_root("/runs/dtrain_k", "s3://b/p/") == "s3://b/p/dtrain_k/outputs"


def test_output_flag_binds_names_to_identifiers():
    assert RunConfig(outputs={"preds": "df"}).outputs == (("preds", "df"),)
    assert "--output a=x --output b=y" in RunConfig(outputs=["a=x", "b=y"]).flag_line()
    for bad, why in [("preds", "is not NAME=VARIABLE"), ({"preds": "my df"}, "variable 'my df'"),
                     (["a=x", "a=y"], "a given twice"), (["a=x", "b=x"], "x given twice")]:
        with pytest.raises(ConfigError, match=why) as info:
            RunConfig(outputs=bad)
        assert "--output" in str(info.value)


@pytest.mark.parametrize("given, pairs", [("preds", (("preds", "preds"),)), (["a", "b"], (("a", "a"), ("b", "b"))),
                                          (("a",), (("a", "a"),)), (None, ())])
def test_run_takes_outputs_by_name_each_its_own_key_in_result_tables(given, pairs):
    from dtrain_magic import api

    for keyword in ("outputs", "output"):  # the field, and the flag's long name, as every keyword option
        values, rest = api.split_options({keyword: given})
        assert rest == {} and api.config_from_options(values).outputs == pairs


@pytest.mark.parametrize("given, why", [
    (5, "got 5; give the name ctx.write(NAME, ...) writes, or a list of them"),
    ({"preds": "df"}, "give the name ctx.write"),  # a notebook's NAME=VARIABLE has no variable here
    ("preds=df", "got the output name 'preds=df'; it must be a Python identifier"),
    (["a", 1], "got the output name 1"),
    (["a", "b", "a"], "a given twice; each output once"),
])
def test_a_bad_outputs_keyword_is_refused_naming_it_before_anything_starts(given, why):
    import dtrain_magic

    def score(ctx):
        raise AssertionError("never launched")

    with pytest.raises(ConfigError, match=re.escape(why)) as info:
        dtrain_magic.run(score, backend="local", outputs=given)
    assert str(info.value).startswith("outputs=")


def test_run_returns_the_outputs_it_names_as_tables_and_says_which_it_did_not_write(tmp_path, capsys):
    """``outputs=["preds", "nope"]``: ``result.tables["preds"]`` the backend's table (a pyarrow Dataset on local);
    "nope", never written, is said with what was (no table, no error: the run's result stands)."""
    import pyarrow.dataset as ds

    from dtrain_magic.driver.runner import bind_result, return_tables
    from dtrain_magic.result import RunResult

    written = commit(str(tmp_path / "outputs"), {0: write_rank(tmp_path / "outputs", 0, range(0, 7))})
    config = RunConfig(backend="local", outputs=(("preds", "preds"), ("nope", "nope")))
    result = RunResult(None, [None], None, config, 0.0, outputs=written)
    return_tables(config, result)
    assert list(result.tables) == ["preds"] and isinstance(result.tables["preds"], ds.Dataset)
    assert result.tables["preds"].count_rows() == 7
    assert ("dtrain_magic: outputs='nope': no output 'nope' was written (ctx.write('nope', batch)); written: preds; "
            "result.tables has no 'nope'") in capsys.readouterr().out
    magic = RunResult(None, [None], None, RunConfig(backend="local", outputs=["preds=df"]), 0.0, outputs=written)
    namespace: dict = {}
    bind_result(namespace, magic.config, magic)  # the magic's --output: the same table, bound and in tables
    assert namespace["df"] is magic.tables["preds"] and namespace["df"].count_rows() == 7


def staged(tmp_path, rows: int, batch_rows: int) -> StagedSource:
    table = pa.table({"x": np.arange(rows, dtype=np.float32) * 2})
    path = str(tmp_path / "data.arrow")
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=batch_rows):
            writer.write_batch(batch)
    blocks = ArrowFileBlocks(path, tuple(b.num_rows for b in table.to_batches(max_chunksize=batch_rows)))
    return StagedSource("val", "numpy array", rows, table.schema, blocks)


@pytest.mark.parametrize("shuffle", [False, True])
def test_with_ids_gives_each_row_its_position_in_the_source(tmp_path, shuffle):
    source = staged(tmp_path, 50, 7)
    seen = []
    for rank in (0, 1):
        for batch in DataBatches(source, rank, 2, 8, shuffle=shuffle, shuffle_window=10, with_ids=True):
            assert torch.equal(batch["x"], batch["row_id"].float() * 2)  # the id is the row's, after the shuffle
            seen += batch["row_id"].tolist()
    assert sorted(seen) == list(range(50))
    keyed = next(iter(DataBatches(source, 0, 1, 8, with_ids="key")))
    assert sorted(keyed) == ["key", "x"]
    with pytest.raises(ValueError, match="already has a column 'x'"):
        DataBatches(source, 0, 1, 8, with_ids="x")


@pytest.mark.parametrize("world, tp, pp, writers", [(2, 1, 1, {0, 1}), (4, 2, 1, {0, 2}), (4, 1, 2, {2, 3}),
                                                    (8, 2, 2, {4, 6}), (2, 2, 1, {0})])
def test_one_rank_of_each_model_replica_writes_its_rows(world, tp, pp, writers):
    """--tp/--pp: every rank of a replica sees the same batches; only the first shard of the last stage (which holds
    the replica's output) writes, so each data-parallel rank's rows are written once."""
    from types import SimpleNamespace

    from dtrain_magic.worker.context import TrainContext

    config = SimpleNamespace(tp=tp, pp=pp)
    found = {rank for rank in range(world)
             if TrainContext._writes_outputs(SimpleNamespace(config=config, world_size=world, rank=rank))}
    assert found == writers and len(found) == world // (tp * pp)


def test_a_run_stopped_early_discards_again_what_a_stopping_worker_wrote_meanwhile(tmp_path):
    from dtrain_magic.driver.outputs import discard, discard_later

    root = tmp_path / "dtrain_k" / "outputs"
    write_rank(root, 0, range(0, 5))
    discard(str(root))
    write_rank(root, 1, range(5, 9))  # a worker still being stopped writes once more
    discard_later(str(root), 0.05).join(5)
    assert not (tmp_path / "dtrain_k").exists()


@pytest.mark.parametrize("rows, ranks, batch, shuffle", [(50, 3, 8, False), (50, 3, 8, True), (5, 4, 1, False),
                                                         (50, 2, 8, True)])
def test_pad_false_reads_every_row_exactly_once_in_the_same_number_of_batches(tmp_path, rows, ranks, batch, shuffle):
    """Scoring: without the even split's padding every row is read once; a rank whose share ran out gets empty
    batches, so every rank still has len() batches (a collective in the loop never waits for a missing peer)."""
    source = staged(tmp_path, rows, 7)
    seen, counts = [], set()
    for rank in range(ranks):
        loader = DataBatches(source, rank, ranks, batch, shuffle=shuffle, shuffle_window=10, with_ids=True, pad=False)
        batches = list(loader)
        counts.add((len(batches), len(loader)))
        for each in batches:
            assert torch.equal(each["x"], each["row_id"].float() * 2)
            seen += each["row_id"].tolist()
    assert sorted(seen) == list(range(rows)) and len(counts) == 1 and len({n for pair in counts for n in pair}) == 1
    plain = [DataBatches(source, rank, ranks, batch, shuffle=shuffle, shuffle_window=10, pad=False)
             for rank in range(ranks)]  # without ids: the same rows, and no key of its own in the batches
    values = sorted(v for loader in plain for each in loader for v in (each["x"] / 2).long().tolist())
    assert values == list(range(rows)) and all(list(each) == ["x"] for each in plain[-1])


def test_an_output_reads_as_a_spark_dataframe_with_the_session_given_or_active(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import dtrain_magic._compat.spark as spark_compat
    from dtrain_magic.data.outputs import Output

    output = Output("preds", str(tmp_path / "preds"), 3, (("id", "int64"),))
    read = []
    spark = SimpleNamespace(read=SimpleNamespace(parquet=lambda path: read.append(path) or "DataFrame"))
    assert output.to_spark(spark) == "DataFrame" and read == [output.path]
    monkeypatch.setattr(spark_compat, "default_session", lambda: None)
    with pytest.raises(RuntimeError, match="output 'preds': no active SparkSession"):
        output.to_spark()
    monkeypatch.setattr(spark_compat, "default_session", lambda: spark)
    assert output.to_spark() == "DataFrame" and read == [output.path] * 2
