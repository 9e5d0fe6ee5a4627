"""Ray Train loops: ``ray.train.report`` metrics into the run on ``--backend ray``; refused elsewhere.

On ``--backend ray`` the user's function runs inside Ray Train's own ``train_loop_per_worker``, so
``ray.train.get_context()``, ``ray.train.torch.prepare_model`` / ``prepare_data_loader``,
``ray.train.report(metrics, checkpoint=...)``, ``ray.train.get_checkpoint()`` and
``FailureConfig(max_failures)`` (``--max-restarts``) are Ray's own. The one addition: what rank 0
reports also goes to the magic's MLflow run and live charts, at step ``metrics["step"]`` (or
``metrics["epoch"]``) when that is an int, else the number of earlier reports with metrics.

On local and Spark there is no Ray Train session: the worker functions raise a short
`UnsupportedCodeError` saying to use ``--backend ray`` (the notebook refuses such a function before
launch when it can see the calls; this catches the rest, e.g. calls made from an imported module).
"""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedCodeError
from . import log_metrics, patch

_WORKER_FUNCTIONS = {
    "ray.train": ("report", "get_context", "get_checkpoint", "get_dataset_shard", "get_all_reported_checkpoints"),
    "ray.train.torch": ("prepare_model", "prepare_data_loader", "prepare_optimizer", "get_device", "backward"),
}


def patch_report() -> None:
    """Wrap ``ray.train.report`` (every rank calls it; rank 0's metrics reach the run)."""
    import ray.train

    original = ray.train.report
    state = {"count": 0}

    def report(metrics: dict, checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        if metrics:
            step = report_step(metrics, state["count"])
            state["count"] += 1
            log_metrics(metrics, step)
        return original(metrics, checkpoint, *args, **kwargs)

    report.__wrapped__ = original  # type: ignore[attr-defined]
    report.__module__, report.__qualname__ = "ray.train", "report"  # pickled by reference like Ray's own
    patch(ray.train, "report", report)


def report_step(metrics: dict, count: int) -> int:
    """The MLflow step of a report: its int ``step``, else its int ``epoch`` (so a restarted group that
    reports a resumed epoch again writes that epoch's step again), else the number of earlier reports."""
    for key in ("step", "epoch"):
        value = metrics.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return count


def refusal(name: str) -> Any:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise UnsupportedCodeError(
            f"{name}() works only inside Ray Train: run this cell with --backend ray (a Ray Train loop runs "
            "there unchanged), or use ctx (ctx.rank, ctx.prepare, ctx.log, ctx.save_checkpoint) on this backend"
        )

    refused.__name__ = name.rsplit(".", 1)[-1]
    return refused


def refuse(module: Any) -> None:
    """Replace ``ray.train``'s worker functions with ones that raise the short error."""
    for name in _WORKER_FUNCTIONS.get(module.__name__, ()):
        if hasattr(module, name):
            patch(module, name, refusal(f"{module.__name__}.{name}"))
