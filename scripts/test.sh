#!/usr/bin/env bash
# Set up .venv (as scripts/setup.sh) and run the whole test suite: unit, integration (real local,
# Spark, Ray, DeepSpeed runs), e2e (notebooks through a real kernel, JupyterLab in headless Chromium),
# the widget's JS unit tests and ruff (lint and import order: a finding fails the command).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/check_java.sh
if [ -f scripts/install_browser.sh ]; then bash scripts/install_browser.sh; fi
export SPARK_LOCAL_IP="${SPARK_LOCAL_IP:-127.0.0.1}" DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}" RAY_USAGE_STATS_ENABLED=0
if [ -d js ] && ls js/*.test.* >/dev/null 2>&1 && command -v node >/dev/null; then
    echo "== JS unit tests (node --test js/)"
    node --test js/
fi
echo "== ruff (lint and import order, pyproject.toml [tool.ruff])"
.venv/bin/ruff check dtrain_magic tests benchmarks scripts
echo "== Python tests"
.venv/bin/python -m pytest -ra --durations=40 "$@"
