"""Writes the example notebooks, notebooks/NAME.ipynb (kept as code so their cells are reviewed like code).

Usage: python scripts/make_notebooks.py [NAME ...]   (default: every notebook)
"""

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

QUICKSTART = [
    new_markdown_cell(
        "# dtrain_magic quickstart\n\n"
        "Train a small regression model on 2 processes with DDP on this machine (the `local` backend), "
        "tracked in MLflow (an SQLite file `mlflow.db` in the working directory). The same cell runs on "
        "Spark or Ray by changing `--backend`, and under FSDP or DeepSpeed by changing `--strategy`."
    ),
    new_code_cell("%load_ext dtrain_magic"),
    new_markdown_cell("Helpers from an earlier cell are shipped to the workers with the training function."),
    new_code_cell(
        "import torch\n"
        "\n"
        "def make_dataset(n=512, features=16, seed=0):\n"
        "    g = torch.Generator().manual_seed(seed)\n"
        "    X = torch.randn(n, features, generator=g)\n"
        "    true_w = torch.arange(features, dtype=torch.float32) / features\n"
        "    y = X @ true_w + 0.01 * torch.randn(n, generator=g)\n"
        "    return torch.utils.data.TensorDataset(X, y.unsqueeze(1))\n"
        "\n"
        "def make_model(features=16):\n"
        "    return torch.nn.Sequential(torch.nn.Linear(features, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))"
    ),
    new_code_cell(
        "%%distribute --backend local --strategy ddp -n 2 --experiment quickstart --seed 0 --result run\n"
        "def train(ctx):\n"
        "    epochs, global_batch = 5, 64\n"
        "    loader = torch.utils.data.DataLoader(make_dataset(), batch_size=global_batch // ctx.world_size, "
        "shuffle=True)\n"
        "    model = make_model()\n"
        "    opt = torch.optim.Adam(model.parameters(), lr=1e-2)\n"
        "    model, opt, loader = ctx.prepare(model, opt, loader)\n"
        "    ctx.set_total(epochs * len(loader))\n"
        "    for epoch in range(epochs):\n"
        "        for x, y in loader:\n"
        "            loss = torch.nn.functional.mse_loss(model(x), y)\n"
        "            ctx.backward(loss)\n"
        "            ctx.step()\n"
        "            ctx.log(loss=loss.item())\n"
        "        if ctx.is_main:\n"
        "            print(f'epoch {epoch}: loss {loss.item():.4f}')\n"
        "    return {'final_loss': loss.item(), 'rank': ctx.rank}"
    ),
    new_code_cell("print(run.value)\nprint('every rank:', run.values)\nprint('MLflow run:', run.run_id, run.metrics)"),
    new_code_cell(
        "from mlflow import MlflowClient\n"
        "client = MlflowClient(run.tracking_uri)\n"
        "info = client.get_run(run.run_id)\n"
        "history = client.get_metric_history(run.run_id, 'loss')\n"
        "print(info.info.status, len(history), 'loss points; first', round(history[0].value, 4), "
        "'last', round(history[-1].value, 4))\n"
        "assert info.info.status == 'FINISHED' and history[-1].value < history[0].value"
    ),
]


SCORING = [
    new_markdown_cell(
        "# Scoring a Spark DataFrame, joined back in Spark\n\n"
        "Train a small regression model on a Spark DataFrame (2 processes, DDP, through Spark's TorchDistributor), "
        "score the validation DataFrame with it, and join the predictions to the validation rows in Spark. No row "
        "passes through the notebook: `--data` hands each DataFrame to the ranks (Spark writes it once as Parquet, "
        "each rank reads its share), and `ctx.write` with `--output` brings the scored rows back as Parquet that "
        "Spark reads ([docs/data.md](../docs/data.md#the-way-back-ctxwrite-and---output))."
    ),
    new_code_cell("%load_ext dtrain_magic"),
    new_markdown_cell(
        "The data: a synthetic regression made by Spark, with an `id` column to join on, split into train and "
        "validation DataFrames. The magic uses the active SparkSession as it is (on Databricks, the notebook's "
        "`spark`)."
    ),
    new_code_cell(
        "from pyspark.sql import SparkSession\n"
        "from pyspark.sql import functions as F\n"
        "\n"
        "spark = SparkSession.builder.master('local[2]').config('spark.ui.enabled', 'false').getOrCreate()\n"
        "\n"
        "FEATURES = 8\n"
        "x = [F.col(f'x{i}') for i in range(FEATURES)]\n"
        "label = sum(x[i] * (i + 1) / FEATURES for i in range(FEATURES)) + 0.1 * F.randn(seed=FEATURES)\n"
        "df = (spark.range(5000, numPartitions=2)\n"
        "      .select('id', *[F.randn(seed=i).alias(f'x{i}') for i in range(FEATURES)])\n"
        "      .select('id', F.array(*x).cast('array<float>').alias('features'), label.cast('float').alias('label')))\n"
        "train_df, val_df = df.randomSplit([0.8, 0.2], seed=0)"
    ),
    new_markdown_cell(
        "The model, and where its trained weights go: a directory every rank reads (on a cluster, a shared path "
        "such as `/dbfs/...`). What the functions below use from earlier cells travels to the workers with them."
    ),
    new_code_cell(
        "import os\n"
        "import torch\n"
        "\n"
        "MODEL_DIR = os.path.abspath('scoring_model')\n"
        "\n"
        "def make_model():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))"
    ),
    new_markdown_cell(
        "Train. `--data train=train_df` gives the DataFrame to the run by name; `ctx.data('train', ...)` is this "
        "rank's share of it, in batches of tensors, one per column. `ctx.save_weights` writes the trained weights "
        "(safetensors, from rank 0)."
    ),
    new_code_cell(
        "%%distribute --backend spark -n 2 --seed 0 --data train=train_df\n"
        "def train(ctx):\n"
        "    model = make_model()\n"
        "    model, opt = ctx.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2))\n"
        "    loader = ctx.data('train', batch_size=64, shuffle=True)\n"
        "    for epoch in range(3):\n"
        "        loader.set_epoch(epoch)\n"
        "        for batch in loader:\n"
        "            loss = torch.nn.functional.mse_loss(model(batch['features']).squeeze(1), batch['label'])\n"
        "            ctx.backward(loss)\n"
        "            ctx.step()\n"
        "            ctx.log(loss=loss.item())\n"
        "        if ctx.is_main:\n"
        "            print(f'epoch {epoch}: loss {loss.item():.4f}')\n"
        "    ctx.save_weights(MODEL_DIR)"
    ),
    new_markdown_cell(
        "Score the validation DataFrame with the trained weights (`weights=`). `pad=False` reads every row exactly "
        "once; each rank appends its rows, with their `id`, to the output `preds` (`ctx.write`). The rows are "
        "committed once every rank returned, and `--output preds=preds` binds them to a Spark DataFrame read from "
        "the written Parquet, never collected. (In a [session](../docs/sessions.md), a model trained in one "
        "`%%ranks` cell scores in the next, without being saved and loaded.)"
    ),
    new_code_cell(
        "%%distribute --backend spark -n 2 --data val=val_df --output preds=preds\n"
        "def score(ctx):\n"
        "    model, _ = ctx.prepare(make_model(), weights=MODEL_DIR)\n"
        "    model.eval()\n"
        "    with torch.no_grad():\n"
        "        for batch in ctx.data('val', batch_size=256, pad=False):\n"
        "            ctx.write('preds', {'id': batch['id'], 'pred': model(batch['features']).squeeze(1)})"
    ),
    new_markdown_cell(
        "Join the predictions to the validation rows on `id` and compute the RMSE, in Spark. A model that always "
        "predicted the mean label would score the label's standard deviation."
    ),
    new_code_cell(
        "scored = val_df.join(preds, 'id', 'left')  # every validation row, its prediction null if it had none\n"
        "rmse = F.sqrt(F.avg((scored.pred - scored.label) ** 2))\n"
        "summary = scored.agg(F.count('*').alias('rows'), F.count('pred').alias('scored'),\n"
        "                     F.countDistinct('id').alias('ids'), rmse.alias('rmse'),\n"
        "                     F.stddev_pop('label').alias('label_std')).first()\n"
        "print(f'{summary.scored} of {summary.rows} validation rows scored, {summary.ids} distinct ids')\n"
        "print(f'RMSE {summary.rmse:.4f} (predicting the mean: {summary.label_std:.4f})')"
    ),
]

SWEEP = [
    new_markdown_cell(
        "# Sweeps: many configurations of one distributed function\n"
        "\n"
        "`%%distribute --sweep SPACE` runs the cell's training function once per *trial*, each trial a run of its "
        "own (here 2 processes on this machine), with the trial's hyperparameters in `ctx.params`. "
        "[Optuna](https://optuna.org) samples the trials and prunes the bad ones; MLflow gets one parent run with a "
        "child per trial. On Spark and Ray the trials after the first run on the first trial's workers (no launch "
        "between trials). The whole story: `docs/sweeps.md`."
    ),
    new_code_cell("%load_ext dtrain_magic"),
    new_markdown_cell(
        "A grid of learning rates and two strategies: 6 trials, as many at once as this machine's cores hold (here "
        "one trial of 2 processes at a time on 2 cores). A name that is a run option (`strategy`, `zero`, "
        "`precision`, `num_processes`, ...) sets the trial's run; any other is `ctx.params[NAME]`. While it runs, "
        "the panel overlays every trial's `--metric` curve and lists the trials; at the end it draws the "
        "parameters against the metric."
    ),
    new_code_cell(
        '%%distribute -n 2 --cpu --seed 0 --metric loss --result sweep '
        '--sweep "lr=grid(0.5,0.1,0.02) strategy=grid(ddp,fsdp)"\n'
        "import torch\n"
        "\n"
        "x = torch.linspace(-1, 1, 64).unsqueeze(1)\n"
        "y = 3 * x - 1\n"
        "\n"
        "def train(ctx):\n"
        "    model = torch.nn.Linear(1, 1)\n"
        "    lr = ctx.params['lr']                         # the trial's, the same on every rank\n"
        "    opt = torch.optim.SGD(model.parameters(), lr=lr)\n"
        "    model, opt = ctx.prepare(model, opt)          # DDP or FSDP: the trial's strategy\n"
        "    for step in range(30):\n"
        "        loss = torch.nn.functional.mse_loss(model(x), y)\n"
        "        ctx.backward(loss)\n"
        "        ctx.step()\n"
        "        ctx.log(loss=loss.item())                 # --metric loss: the curve, and the pruner's"
    ),
    new_markdown_cell("The best trial, and every trial as a pandas DataFrame (Optuna's `trials_dataframe`):"),
    new_code_cell(
        'print(f"best: {sweep.best.params} loss={sweep.best.value:.3g} (MLflow run {sweep.best.run_id})")\n'
        'sweep.trials[["number", "params_lr", "params_strategy", "value", "state"]]'
    ),
    new_markdown_cell(
        "The same from plain Python, with a log-uniform learning rate sampled by Optuna's TPE and its median "
        "pruner: a trial whose loss lags the median of the finished trials' at the same step is stopped, every rank "
        "after the same step (rates above 1 diverge here). The steps are slowed down so that the pruner sees the "
        "curves while they run."
    ),
    new_code_cell(
        "import time\n"
        "\n"
        "import optuna\n"
        "import dtrain_magic\n"
        "\n"
        "def train_slowly(ctx):\n"
        "    model = torch.nn.Linear(1, 1)\n"
        "    opt = torch.optim.SGD(model.parameters(), lr=ctx.params['lr'])\n"
        "    model, opt = ctx.prepare(model, opt)\n"
        "    for step in range(40):\n"
        "        loss = torch.nn.functional.mse_loss(model(x), y)\n"
        "        ctx.backward(loss)\n"
        "        ctx.step()\n"
        "        ctx.log(loss=min(loss.item(), 1e30))\n"
        "        time.sleep(0.05)\n"
        "\n"
        "median = optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=5)\n"
        'tpe = dtrain_magic.sweep(train_slowly, "lr=loguniform(1e-3,3)", trials=6, metric="loss",\n'
        "                         num_processes=2, cpu=True, seed=3, pruner=median, ui=False)\n"
        "print(f\"best: lr={tpe.best.params['lr']:.3g} loss={tpe.best.value:.3g}\")\n"
        'tpe.trials[["number", "params_lr", "value", "state", "user_attrs_stopped_at_step"]]'
    ),
]

NOTEBOOKS = {"quickstart": QUICKSTART, "scoring": SCORING, "sweep": SWEEP}
FOLDER = Path(__file__).resolve().parent.parent / "notebooks"


def write_notebook(name: str) -> Path:
    """notebooks/NAME.ipynb from its cells, outputs empty; cell ids from their position, so that writing it again
    changes only what the cells changed."""
    cells = NOTEBOOKS[name]
    for index, cell in enumerate(cells):
        cell.id = f"{name}-{index}"
    notebook = new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = FOLDER / f"{name}.ipynb"
    nbformat.write(notebook, path)
    return path


def main(argv: list[str]) -> None:
    for name in argv or NOTEBOOKS:
        print(write_notebook(name))


if __name__ == "__main__":
    main(sys.argv[1:])
