"""A missing optional dependency is a one-paragraph error naming it and the fix, with nothing launched.

Each case runs a real IPython shell in a fresh interpreter in which the package cannot be imported
(an import hook makes it look uninstalled), or without Java on PATH.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import json, sys
    BLOCKED = [name for name in sys.argv[1].split(",") if name]
    class Uninstalled:
        def find_spec(self, name, path=None, target=None):
            if any(name == blocked or name.startswith(blocked + ".") for blocked in BLOCKED):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None
    sys.meta_path.insert(0, Uninstalled())
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext dtrain_magic", store_history=False)
    outcome = shell.run_cell(sys.argv[2] + "\\nSIDE = 1\\ndef train(ctx):\\n    return 1\\n")
    error = outcome.error_in_exec
    import os
    store_created = os.path.exists(os.environ["MLFLOW_TRACKING_URI"][len("sqlite:///"):])
    from mlflow import MlflowClient
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    print(json.dumps({
        "store_created": store_created,
        "type": type(error).__name__,
        "text": "\\n".join(error._render_traceback_()) if hasattr(error, "_render_traceback_") else repr(error),
        "cell_ran": "SIDE" in shell.user_ns,
        "experiments": [e.name for e in client.search_experiments() if e.name != "Default"],
        "still_usable": shell.run_cell("2 + 3").result == 5,
        "value": getattr(outcome.result, "value", None),
        "loaded": sorted(
            {m.split(".")[0] for m in sys.modules} & {"pyspark", "ray", "ipywidgets", "plotly", "anywidget"}
        ),
    }))
    """
)


def run_case(tmp_path, blocked, line, env_changes=None):
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}", **(env_changes or {}))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, blocked, line],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "blocked, line, fix",
    [
        ("ray", "%%distribute --backend ray -n 2 --no-ui", "pip install"),
        ("pyspark", "%%distribute --backend spark -n 2 --no-ui", "pip install"),
        ("deepspeed", "%%distribute --zero 2 -n 2 --no-ui", "pip install"),
    ],
)
def test_missing_package(tmp_path, blocked, line, fix):
    result = run_case(tmp_path, blocked, line)
    assert result["type"] == "MissingDependencyError", result
    assert blocked in result["text"].lower() and fix in result["text"]
    assert len(result["text"].splitlines()) <= 3, result["text"]
    assert result["cell_ran"] is False and result["experiments"] == [] and result["still_usable"]
    assert result["store_created"] is False  # not even an MLflow store was opened


def test_missing_java(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(sys.executable, bin_dir / "python")
    result = run_case(tmp_path, "", "%%distribute --backend spark -n 2 --no-ui",
                      {"PATH": str(bin_dir), "JAVA_HOME": str(tmp_path / "no-java")})
    assert result["type"] == "MissingDependencyError", result
    assert "java" in result["text"].lower() and "17" in result["text"]
    assert result["cell_ran"] is False and result["experiments"] == []


def test_local_backend_needs_neither_spark_nor_ray_and_no_widgets(tmp_path):
    """--backend local with pyspark, ray and the widget packages all uninstalled: it trains, and --ui
    falls back to plain text (nothing requires widgets to render)."""
    result = run_case(
        tmp_path, "pyspark,ray,ipywidgets,plotly,anywidget", "%%distribute --backend local -n 2 --cpu --ui"
    )
    assert result["type"] == "NoneType" and result["value"] == 1, result
    assert result["loaded"] == [] and result["cell_ran"] and result["experiments"] == ["dtrain_magic"]


def test_configure_without_widgets_is_a_clear_error(tmp_path):
    result = run_case(tmp_path, "ipywidgets", "%%distribute --configure -n 2")
    assert result["type"] == "MissingDependencyError", result
    assert "ipywidgets" in result["text"] and "pip install" in result["text"]
    assert len(result["text"].splitlines()) <= 3, result["text"]
    assert result["cell_ran"] is False and result["experiments"] == [] and result["still_usable"]
