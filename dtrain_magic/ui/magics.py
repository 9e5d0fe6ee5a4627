"""``%distribute_show RUN_ID``: draw a run's charts again from MLflow alone (finished or still running)."""

from __future__ import annotations

from typing import Any

from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ..magic_line import takes_comments


def show_run(run_id: str, tracking_uri: str | None = None, display: bool = True, interval_s: float = 0.5) -> Any:
    """The `charts.RunCharts` of ``run_id``; polls live until the run ends when it is still running."""
    import ipywidgets as w
    from mlflow import MlflowClient

    from ..config import default_tracking_uri
    from ..errors import ConfigError
    from .charts import TERMINAL, RunCharts

    client = MlflowClient(tracking_uri=tracking_uri or default_tracking_uri())
    try:
        run = client.get_run(run_id)
    except Exception as exc:
        raise ConfigError("RUN_ID", f"no MLflow run {run_id!r} in {tracking_uri or default_tracking_uri()}: "
                          f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    charts = RunCharts(client, run_id, interval_s=interval_s)
    charts.poll_once()
    if run.info.status not in TERMINAL:
        charts.start()
    if display:
        from IPython.display import display as show

        params = run.data.params
        header = w.HTML(
            f"<b>dtrain_magic run {run_id}</b> · {run.info.status} · "
            f"{params.get('backend', '?')}/{params.get('strategy', '?')}, "
            f"{params.get('num_processes', '?')} processes, "
            f"{params.get('precision', '?')}"
        )
        box = w.VBox([header, charts.widget])
        box.add_class("dtm-show")
        show(box)
    return charts


@magics_class
class UIMagics(Magics):
    """Magics of the dtrain_magic front-end."""

    @magic_arguments()
    @argument("run_id", help="the MLflow run id (RunResult.run_id, or the id shown in the panel)")
    @argument("--tracking-uri", default=None,
              help="MLflow tracking URI (None means $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here)")
    @line_magic
    @takes_comments
    def distribute_show(self, line: str) -> None:
        """Show the metric and system charts of a ``%%distribute`` run, read from MLflow."""
        args = parse_argstring(self.distribute_show, line)
        charts = show_run(args.run_id, args.tracking_uri)
        self.shell.user_ns["_distribute_charts"] = charts
        return None
