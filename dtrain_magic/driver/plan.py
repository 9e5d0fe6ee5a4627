"""Before a run: `check` every input once (`RunPlan`), `check_payload` the captured function, `dry_run_text`.

`check` does every check before anything runs and returns the `RunPlan` that `runner.execute` runs without
looking anything up again: the launcher, the tracking URI and what its store says of the experiment, whether
the workers start before the MLflow run, and (asked once, when the run starts) the channel host.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping

from ..backends import backends_that
from ..config import RunConfig
from ..errors import ConfigError
from ..launchers import Launcher, get_launcher
from ..payload import Payload
from ..registry import BACKENDS
from ..state import kernel_state
from ..strategies import get_strategy
from ..tracking import check_tracking_uri, preload_mlflow, resolve_tracking_uri, sqlite_experiment_stage
from ..tracking.uri import deleted_experiment_error


@dataclass(frozen=True)
class RunPlan:
    """What `check` found out about one run, so that `execute` looks nothing up again.

    ``launcher``: the backend's (cached) `Launcher`. ``tracking_uri``: the MLflow store checked (``--tracking-uri``,
    else ``MLFLOW_TRACKING_URI``, else ``./mlflow.db``); ``store_stage``: what that store says of the experiment
    without MLflow (`tracking.sqlite_experiment_stage`: "active", "absent", or None when it cannot tell; "deleted"
    never gets this far). ``starts_before_tracking``: the workers start before the MLflow run exists (see `check`).
    A plan is for one run: the next run checks again (the store, a session may have changed meanwhile).
    """

    config: RunConfig
    launcher: Launcher
    strategy: type  # the `Strategy` class (`check` looked it up; it travels with the job)
    tracking_uri: str
    store_stage: str | None
    starts_before_tracking: bool
    data: Any = None  # the run's data sources (`dtrain_magic.driver.data_plan.DataPlan`), found by `check_data`

    @cached_property
    def channel_host(self) -> str:
        """Where the run's channel listens (`Launcher.channel_host`), asked once, when the run starts: after
        `Launcher.warm_up`, which Ray's answer needs (its connection), so that a dry run never starts Ray."""
        return self.launcher.channel_host(self.config)


def check(config: RunConfig) -> RunPlan:
    """Everything that can be checked before launch, each looked up once; raises `DistributeError` subclasses.

    Returns the `RunPlan` that `execute` runs. The workers start before the MLflow run exists when the backend
    does not need the run's id and nothing can go wrong with the run that a look at the store did not already
    rule out (a writable SQLite file, the experiment not deleted): a kernel's first run then does not wait for
    MLflow's import (about 2 s of CPU here), which waits until the workers are past their start so it does not
    slow them either. Otherwise MLflow's import starts now, beside the rest of the check and the cell's capture.
    """
    launcher = get_launcher(config.backend)
    uri = resolve_tracking_uri(config)
    stage = sqlite_experiment_stage(uri, config.experiment)
    early = launcher.starts_before_tracking(config) and stage in ("active", "absent")
    if not early:
        preload_mlflow()  # the run will need MLflow first: import it meanwhile (a SparkSession start, the capture)
    launcher.check(config)
    for session in kernel_state().sessions():  # an open session's ranks are its own: the run must fit beside them
        session.check_beside(config)
    strategy = get_strategy(config.strategy)
    strategy.check(config)
    check_tracking_uri(config)  # it may wait up to a few seconds for an http(s) server
    if stage == "deleted":
        raise deleted_experiment_error(config, uri)
    return RunPlan(config, launcher, strategy, uri, stage, early)


def check_payload(config: RunConfig, payload: Payload) -> None:
    """What the captured function needs of the backend, before launch: a Ray Train loop (it calls
    ``ray.train``) runs only on a backend whose workers are Ray Train's (``ray_train``: ``--backend ray``), where Ray
    Train's own session exists."""
    if payload.uses_ray_train and not BACKENDS.facts(config.backend).ray_train:
        raise ConfigError(
            "--backend",
            f"{payload.call_text or payload.name} calls Ray Train "
            "(ray.train.report / get_context / prepare_model ...), "
            f"which works only inside Ray Train: run it with --backend {backends_that('ray_train')}, where it runs "
            "unchanged, not --backend "
            f"{config.backend} (or use ctx.rank, ctx.prepare, ctx.log instead). Nothing was launched",
        )


def check_data(plan: RunPlan, payload: Payload, namespace: Mapping[str, Any] | None) -> RunPlan:
    """The run's ``--data`` sources found in ``namespace`` (the notebook's, `dtrain_magic.run`'s ``data=`` objects;
    None on the command line) and checked before launch, with the names the function reads (``ctx.data("x")``);
    the plan with them (`RunPlan.data`). A dry run also counts sources otherwise counted when they are written."""
    config = plan.config
    if not config.data and not payload.data_names:
        return plan
    from .data_plan import check_data_dir, resolve

    if config.data_dir is not None:
        check_data_dir(config.data_dir)
    data = resolve(config, plan.launcher.workers_share_files(config), namespace, payload.data_names,
                   payload.call_text or payload.name, count=config.dry_run)
    return dataclasses.replace(plan, data=data)


def dry_run_text(plan: RunPlan, payload: Payload, model: Any = None, equivalent: str | None = None) -> str:
    """What ``--dry-run`` prints for a checked ``plan``: the validated config and what would be launched; with
    ``model`` (a `memory.CellModel`), the memory estimate for the cell's own model, or why it is not known yet;
    ``equivalent``: the line that runs it, as the entry point writes it (default: the ``%%distribute`` line)."""
    from ..strategies.memory import estimate
    from .observer import plan_with_backend

    config, launcher = plan.config, plan.launcher
    call = payload.call_text or (f"{payload.name}(ctx)" if payload.takes_ctx else f"{payload.name}()")
    lines = [
        "dtrain_magic dry run: nothing launched.",
        f"  would run {call} on {plan_with_backend(launcher.describe(config), config)}",
        f"  strategy {get_strategy(config.strategy).label(config.zero)}"
        + f", precision {config.precision}, grad accumulation {config.grad_accum}"
        + (f", model parallel tp {config.tp} x pp {config.pp} x dp {config.data_parallel_size}"
           if config.tp * config.pp > 1 else ""),
    ]
    if plan.data is not None:
        lines += plan.data.dry_run_lines()
    if model is not None and model.found:
        facts = getattr(model, "facts", None)
        settings = get_strategy(config.strategy).memory_settings(config, facts) if facts is not None else None
        activations = getattr(model, "activations", None)
        est = estimate(model.num_params, config.strategy, config.zero, config.precision, config.num_processes,
                       tp=config.tp, pp=config.pp, facts=facts, settings=settings, activations=activations,
                       ac=config.ac)
        lines += [f"  model: {model.num_params:,} parameters, {model.description}", f"  {est.line()}"]
        if getattr(model, "sample_note", ""):
            lines.append(f"  {model.sample_note}")
    elif model is not None:
        lines.append(f"  memory estimate: the model is not known before training ({model.description}); "
                     "each worker prints it at ctx.prepare")
    lines.append(f"  equivalent: {equivalent or config.flag_line()}")
    return "\n".join(lines)
