"""What each ``--backend`` is, readable without loading it: its name, the flags that are its own, what it can do,
and its rules on the flags. `RunConfig`'s validation, the run's plan, the data routes and the workers' integrations
ask these facts (through `dtrain_magic.registry.BACKENDS.facts`) instead of testing a backend's name.

Each backend's `Launcher` (`dtrain_magic.launchers`) inherits its facts class here, so a fact is written once. They
live apart from the launchers because a launcher module imports the channel, the worker and the config: reading a
fact from there would cost those imports (and config → launcher → config would be a circle). This module imports
no backend library: `in_use` looks only at what the notebook already imported.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

from .errors import ConfigError
from .flagtable import DEFAULT_PREEMPT_GRACE_S
from .registry import BACKENDS

if TYPE_CHECKING:
    from .config import RunConfig


def backends_that(fact: str) -> str:
    """The registered backends for which ``fact`` (a class attribute of `Backend`) holds, as words ("spark or ray")."""
    return " or ".join(name for name, facts in BACKENDS.all_facts().items() if getattr(facts, fact, False))


class Backend:
    """One backend's facts (class attributes and classmethods); its `Launcher` subclass adds how it runs."""

    name: ClassVar[str]
    #: `RunConfig` fields that apply only to this backend (``--spark-master``): another backend refuses them.
    own_fields: ClassVar[tuple[str, ...]] = ()
    #: restarts failed workers itself (``--max-restarts N``)
    restarts_workers: ClassVar[bool] = False
    #: launches the next run's workers ahead and keeps them waiting (``--keep-warm S``)
    keeps_workers_warm: ClassVar[bool] = False
    #: ``--resume`` continues a run in a new kernel from its checkpoint root (the workers' ``ctx.load_checkpoint()``)
    resumes_runs: ClassVar[bool] = False
    #: ``--storage`` may be a URL (``s3://``, ``gs://``), not only a path
    storage_urls: ClassVar[bool] = False
    #: the workers are Ray Train's: a Ray Train loop (``ray.train.report``, ``get_context``...) runs in them
    #: unchanged, and a Ray Dataset reaches them as Ray Train's shards (``TorchTrainer(datasets=...)``), no file
    ray_train: ClassVar[bool] = False
    #: relaunches a run that lost workers on the survivors, through the same launcher (``--elastic MIN:MAX``)
    elastic: ClassVar[bool] = False
    #: a SIGTERM to a worker makes every rank checkpoint at the next step boundary (``--preempt-grace S``)
    preemption_notice: ClassVar[bool] = False
    #: the workers are in the notebook's Ray job: an in-memory source reaches them through Ray's object store
    #: (``ray.put`` once), not as a file written on this machine
    object_store: ClassVar[bool] = False
    #: what ``--output NAME=VARIABLE`` binds a committed output as: ``"spark"`` (a Spark DataFrame read from its
    #: parts), ``"ray"`` (a Ray Dataset) or ``"pyarrow"`` (a pyarrow Dataset)
    output_table: ClassVar[str] = "pyarrow"
    #: every rank is a process of this machine, whatever the config: this machine's memory bounds a run (a sweep
    #: skips a trial whose estimate exceeds it), and each run numbers this machine's GPUs from 0 (so a sweep runs
    #: GPU trials one at a time)
    ranks_on_this_machine: ClassVar[bool] = False

    @classmethod
    def validate(cls, config: RunConfig) -> None:
        """Pure rules on the flags for this backend (`RunConfig` calls it): what it cannot do is a `ConfigError`
        naming the flag and the backends that can. Subclasses add their own after calling this."""
        if config.max_restarts and not cls.restarts_workers:
            raise ConfigError("--max-restarts", f"--backend {cls.name} does not restart failed workers; use "
                                                f"--backend {backends_that('restarts_workers')} for restarts")
        if config.keep_warm is not None and not cls.keeps_workers_warm:
            raise ConfigError("--keep-warm", f"applies only to --backend {backends_that('keeps_workers_warm')} (the "
                                             f"next run's workers waiting for it), not --backend {cls.name}")
        if config.resume is not None and not cls.resumes_runs:
            raise ConfigError("--resume", f"--backend {cls.name} cannot resume a run in a new kernel yet (its "
                                          "checkpoints are its own); use --backend "
                                          f"{backends_that('resumes_runs')}")
        if config.elastic is not None and not cls.elastic:
            raise ConfigError("--elastic", f"--backend {cls.name} cannot continue a run on fewer workers yet; use "
                                           f"--backend {backends_that('elastic')}, or --max-restarts N (restarts "
                                           "with the same number of workers)")
        # 0 (no notice) is what every backend does already; a session turns the notice off so
        if config.preempt_grace not in (0, DEFAULT_PREEMPT_GRACE_S) and not cls.preemption_notice:
            raise ConfigError("--preempt-grace", f"--backend {cls.name} does not act on a preemption notice yet "
                                                 f"(a SIGTERM stops its workers); --backend "
                                                 f"{backends_that('preemption_notice')} does")
        if config.storage is not None and "://" in config.storage and not cls.storage_urls:
            raise ConfigError(
                "--storage",
                f"got {config.storage!r}; --backend {cls.name} writes checkpoints as plain files: give a path (on a "
                f"multi-host cluster, one every node can reach, such as /dbfs/...); URLs (s3://, gs://) are for "
                f"--backend {backends_that('storage_urls')}",
            )

    @classmethod
    def in_use(cls, modules: Mapping[str, Any]) -> bool:
        """For ``--backend auto``: is this backend's library in use in the notebook (``modules``: `sys.modules`)?
        Looks only at what is already imported. Default: no."""
        return False


class Local(Backend):
    """torch.distributed on this machine (`dtrain_magic.launchers.local.LocalLauncher`)."""

    name = "local"
    restarts_workers = True  # --max-restarts: the whole group again, resuming from the run's checkpoints
    elastic = True  # --elastic: the survivors relaunched by the same fork server
    preemption_notice = True  # the workers are this machine's processes: their SIGTERM handler is the worker's
    resumes_runs = True  # --resume: ctx.load_checkpoint() reads the run's checkpoint root, whichever kernel
    ranks_on_this_machine = True  # forked by this machine's fork server


class Spark(Backend):
    """pyspark's TorchDistributor (`dtrain_magic.launchers.spark.SparkLauncher`)."""

    name = "spark"
    own_fields = ("local_mode", "spark_master")  # --cluster, --spark-master
    # --max-restarts: TorchDistributor never restarts a rank (Spark aborts a failed barrier stage whole), so the
    # launcher submits a new job per attempt, resuming from the run's checkpoints (launchers/spark/restarts.py)
    restarts_workers = True
    resumes_runs = True  # --resume: as on local (the checkpoint root is a path every worker reads)
    # a SIGTERM to a rank (a machine shutting down SIGTERMs every process): the rank is a torchrun worker's main
    # thread, its handler the worker's; the launcher's own stops kill through the ranks' watchdogs (SIGKILL)
    preemption_notice = True
    keeps_workers_warm = True
    output_table = "spark"  # spark.read.parquet of the committed parts: never collected

    @classmethod
    def in_use(cls, modules: Mapping[str, Any]) -> bool:
        """An active SparkSession in the notebook, classic or Spark Connect (pyspark's own ``getActiveSession`` answers
        with the Connect session once ``builder.remote(...)`` made one; its class's, should pyspark not say)."""
        try:
            if "pyspark.sql" in modules and modules["pyspark.sql"].SparkSession.getActiveSession() is not None:
                return True
            connect = modules.get("pyspark.sql.connect.session")
            return connect is not None and connect.SparkSession.getActiveSession() is not None
        except Exception as exc:  # a half-imported or broken pyspark: not in use
            logging.getLogger(__name__).debug("--backend auto: pyspark's active session unknown (%s)", exc)
            return False


class Ray(Backend):
    """Ray Train's TorchTrainer (`dtrain_magic.launchers.ray.RayLauncher`)."""

    name = "ray"
    own_fields = ("ray_address",)  # --ray-address
    restarts_workers = True  # Ray Train's FailureConfig(max_failures)
    elastic = True  # --elastic: a fit() per attempt, sized to the Ray's nodes (launchers/ray/elastic.py)
    resumes_runs = True  # --resume: a fit() with the run's name and storage restores Ray Train's latest checkpoint
    # the notice is Ray's own: Ray Train's preemption watcher tells every worker when Ray drains a node of the run
    preemption_notice = True
    keeps_workers_warm = True
    storage_urls = True  # Ray Train's run storage: s3://, gs://
    ray_train = True
    object_store = True
    output_table = "ray"  # ray.data.read_parquet of the committed parts

    @classmethod
    def in_use(cls, modules: Mapping[str, Any]) -> bool:
        """Ray initialised in the notebook (by the user's ``ray.init()`` or an earlier run)."""
        try:
            return "ray" in modules and bool(modules["ray"].is_initialized())
        except Exception as exc:  # a half-imported or broken Ray: not in use
            logging.getLogger(__name__).debug("--backend auto: whether Ray is initialised is unknown (%s)", exc)
            return False
