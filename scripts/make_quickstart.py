"""Writes notebooks/quickstart.ipynb (kept as code so the notebook's cells are reviewed like code)."""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = [
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


def main() -> None:
    notebook = new_notebook(cells=CELLS)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"
    nbformat.write(notebook, path)
    print(path)


if __name__ == "__main__":
    main()
