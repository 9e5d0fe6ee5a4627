"""Data at scale: ``--data NAME=SOURCE`` and ``ctx.data(NAME, batch_size, ...)`` (docs/data.md).

A run is handed named sources (Spark DataFrames, Ray Datasets, Parquet paths, objects in the notebook) and every
rank reads only its share of each, never through the notebook's memory:

- `kinds`: one class per kind of source, owning its facts (what it matches, schema, rows, identity, how it reaches
  the ranks on each backend);
- `blocks`: what the workers get (`StagedSource`: where the rows are, as blocks);
- `split`: the even-split rule and the documented order of a rank's rows (pure);
- `columns`: which columns become tensors, and how;
- `reader`: ``ctx.data``'s per-rank reader (`DataBatches`, `RayShardBatches`);
- `usage`: the names a function reads with ``ctx.data("...")``, for the check before launch.

The notebook's side lives above it: `dtrain_magic.dataspec` (the ``--data`` text, pure; `RunConfig` validates with
it), `dtrain_magic.driver.data_plan` (the sources found and checked before launch, `DataPlan`, staged at launch)
and `dtrain_magic.driver.staging` (the kernel's staged copies, reused by a re-run of the same data).

Importing this package imports neither pyarrow nor torch: the modules that need them do.
"""
