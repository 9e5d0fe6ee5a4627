#!/usr/bin/env bash
# Create or update .venv in the repo root with the whole tested stack. Idempotent: a second run with
# unchanged requirements only checks the stamp and returns in about a second.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
"$PYTHON" - <<'PY' || { echo "setup: Python >= 3.10 is needed (found $("$PYTHON" --version 2>&1))" >&2; exit 1; }
import sys
sys.exit(0 if sys.version_info >= (3, 10) else 1)
PY

if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $("$PYTHON" --version)"
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
pip_install() {  # pip, minus the "Location ... is ignored" lines this machine's pip config prints
    "${PIP[@]}" install "$@" 2>&1 | { grep -v "^WARNING: Location 'file:" || true; }
    return "${PIPESTATUS[0]}"
}
stamp=".venv/.dtrain_magic-installed"
want="$(cat requirements.txt requirements-test.txt constraints.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
ops=".venv/var/dtrain_magic/torch_extensions/deepspeed_shm_comm/deepspeed_shm_comm.so"
build_ops() {  # DeepSpeed's CPU op, compiled once here so that no notebook cell ever compiles C++
    echo "setup: building DeepSpeed's CPU op for this environment (about a minute on 2 cores, once)"
    DS_ACCELERATOR=cpu .venv/bin/python -m dtrain_magic.strategies.extensions
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c "import dtrain_magic, torch, deepspeed, ray, pyspark, mlflow, optuna" 2>/dev/null; then
    [ -f "$ops" ] || build_ops
    echo "setup: .venv is up to date"
    exit 0
fi

start=$(date +%s)
# Every install skips pip's own bytecode compilation (one core, about 100 s for the stack's 27,000 modules):
# compileall does it on both cores at the end (about 50 s), so every process still imports from .pyc files.
# torch first, pinned, so that no other package's dependency pulls a (several GB) CUDA build.
echo "setup: installing torch (pinned) and DeepSpeed"
pip_install --no-compile "$(grep -E '^torch==' requirements.txt)"
pip_install --no-compile "$(grep -E '^deepspeed==' requirements.txt)" -c constraints.txt
# The editable build's setuptools warnings are noise here; show them only if it fails.
"${PIP[@]}" install --no-deps -e . > .venv/editable-install.log 2>&1 || { cat .venv/editable-install.log >&2; exit 1; }
# DeepSpeed's op needs only torch and DeepSpeed: it compiles on the core pip leaves idle while the rest installs.
build_ops > .venv/build-ops.log 2>&1 &
ops_pid=$!
echo "setup: installing the stack (ray, pyspark, mlflow, widgets, test tools) while the op builds"
pip_install --no-compile -r requirements.txt -r requirements-test.txt -c constraints.txt
# rfc3987-syntax: jsonschema's optional IRI format checker, pulled in by jupyter-events (JupyterLab). Importing it
# builds a grammar, 1.4 s of CPU in every process that imports jsonschema: every Ray process (Ray validates runtime
# envs with it), which made each Ray Train launch about 40 % slower on 2 cores. jsonschema does without it.
"${PIP[@]}" uninstall -y rfc3987-syntax > /dev/null 2>&1 || true
if wait "$ops_pid"; then
    cat .venv/build-ops.log
else  # e.g. a module it imported was being replaced meanwhile: once more, now that the install is done
    echo "setup: the op build beside the install failed (.venv/build-ops.log); building it again"
    build_ops
fi
echo "setup: compiling the stack's bytecode"
# A few packages ship files that are not Python 3.11 (templates, other versions' code): pip skips them too.
.venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
    > /dev/null 2>&1 || true
echo "$want" > "$stamp"
echo "setup: done in $(( $(date +%s) - start )) s"
