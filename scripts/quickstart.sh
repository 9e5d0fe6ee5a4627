#!/usr/bin/env bash
# Set everything up and run the main job: notebooks/quickstart.ipynb through a real Jupyter kernel,
# on the local backend with MLflow in ./mlflow.db. Prints where the results are.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export SPARK_LOCAL_IP="${SPARK_LOCAL_IP:-127.0.0.1}"
.venv/bin/python scripts/run_notebook.py notebooks/quickstart.ipynb --cwd "$PWD"
