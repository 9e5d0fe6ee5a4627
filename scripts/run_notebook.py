"""Execute a notebook through a real Jupyter kernel (nbclient) and say where its results are.

Usage: python scripts/run_notebook.py notebooks/quickstart.ipynb [--cwd DIR] [--timeout S]
Writes NAME.out.ipynb next to the notebook; exits non-zero if a cell fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook")
    parser.add_argument("--cwd", default=os.getcwd(), help="working directory of the kernel (mlflow.db goes here)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args(argv)

    path = Path(args.notebook).resolve()
    out_path = path.with_suffix(".out.ipynb")
    notebook = nbformat.read(path, as_version=4)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    client = NotebookClient(
        notebook, timeout=args.timeout, kernel_name="python3", resources={"metadata": {"path": args.cwd}}
    )
    started = time.monotonic()
    failed = None
    try:
        client.execute()
    except CellExecutionError as exc:
        failed = exc
    finally:
        nbformat.write(notebook, out_path)
    elapsed = time.monotonic() - started
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                sys.stdout.write(output["text"])
    print(f"\nexecuted notebook: {out_path} ({elapsed:.1f} s)")
    db = Path(args.cwd) / "mlflow.db"
    if db.exists() and "MLFLOW_TRACKING_URI" not in os.environ:
        print(f"MLflow store: sqlite:///{db}  (browse: .venv/bin/mlflow ui --backend-store-uri sqlite:///{db})")
    if failed is not None:
        print(f"a cell failed:\n{str(failed)[-3000:]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
