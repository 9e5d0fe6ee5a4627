"""`dtrain_magic._compat`: each library's private uses checked against the versions they were written for.

The version lookup is monkeypatched (`_compat.installed_version`); the libraries themselves are not
imported unless a test says so.
"""

from __future__ import annotations

import os
import re
import types

import pytest

from dtrain_magic import _compat
from dtrain_magic._compat import cloudpickle as cloudpickle_compat
from dtrain_magic._compat import deepspeed as deepspeed_compat
from dtrain_magic._compat import ipykernel as ipykernel_compat
from dtrain_magic._compat import mlflow as mlflow_compat
from dtrain_magic._compat import plotly as plotly_compat
from dtrain_magic._compat import ray as ray_compat
from dtrain_magic._compat import spark as spark_compat
from dtrain_magic._compat import torch as torch_compat
from dtrain_magic._compat import transformers as transformers_compat
from dtrain_magic.errors import DistributeError, UnsupportedVersionError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIBRARIES = [
    ray_compat.RAY, cloudpickle_compat.CLOUDPICKLE, mlflow_compat.MLFLOW, spark_compat.PYSPARK,
    ipykernel_compat.IPYKERNEL, plotly_compat.PLOTLY, deepspeed_compat.DEEPSPEED, torch_compat.TORCH,
    transformers_compat.TRANSFORMERS,
]


@pytest.fixture
def installed(monkeypatch):
    """``installed("ray", "2.61.0")``: pretend that version is installed (the opt-in variable is unset)."""
    monkeypatch.delenv(_compat.OPT_IN_ENV, raising=False)
    versions: dict[str, str | None] = {}
    monkeypatch.setattr(_compat, "installed_version", lambda distribution, module: versions.get(distribution, "0.0.0"))

    def pretend(distribution: str, version: str | None) -> None:
        versions[distribution] = version

    return pretend


def pins() -> dict[str, str]:
    found = {}
    for name in ("constraints.txt", "requirements.txt"):
        with open(os.path.join(REPO, name)) as handle:
            for line in handle:
                match = re.match(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([^\s;#]+)", line.strip())
                if match:
                    found[match.group(1).lower()] = match.group(2)
    return found


@pytest.mark.parametrize("library", LIBRARIES, ids=lambda lib: lib.key)
def test_each_library_knows_the_pinned_version_that_is_installed(library):
    """The versions written against are those the project pins, and the installed one is known."""
    assert pins()[library.key] == library.tested
    assert any(_compat.in_series(library.tested, series) for series in library.known)
    assert library.is_known(), (library.key, library.version())


@pytest.mark.parametrize("version, series, inside", [
    ("2.60.0", "2.60", True), ("2.60.3", "2.60", True), ("2.60", "2.60", True), ("2.13.0+cpu", "2.13", True),
    ("2.61.0", "2.60", False), ("2.6.0", "2.60", False), ("2.600.1", "2.60", False), ("3.1.3", "3.1", True),
])
def test_release_series(version, series, inside):
    assert _compat.in_series(version, series) is inside


def test_a_known_version_passes(installed):
    installed("ray", "2.60.0")
    ray_compat.RAY.require("the controller")
    installed("ray", "2.60.4")  # a patch release of a known series
    ray_compat.RAY.require("the controller")
    installed("cloudpickle", "3.1.3")
    cloudpickle_compat.check()


@pytest.mark.parametrize("library, found", [(ray_compat.RAY, "2.61.0"), (cloudpickle_compat.CLOUDPICKLE, "3.2.0")])
def test_an_unknown_version_is_a_short_error_naming_library_version_known_versions_and_the_fix(
    installed, library, found
):
    installed(library.key, found)
    with pytest.raises(UnsupportedVersionError) as info:
        library.require("what needs it")
    message = str(info.value)
    assert isinstance(info.value, DistributeError)  # rendered as one short paragraph, not a traceback
    assert f"{library.title} {found} is installed" in message
    assert f"{library.known[0]}.x" in message and f"tested with {library.tested}" in message
    assert f"pip install '{library.requirement}'" in message
    assert f"{_compat.OPT_IN_ENV}={library.key}" in message and "Nothing was launched" in message
    assert "what needs it" in message
    assert len(info.value._render_traceback_()) == 1


def test_a_version_that_cannot_be_read_is_unknown(installed):
    installed("ray", None)
    with pytest.raises(UnsupportedVersionError, match="a version it does not report"):
        ray_compat.RAY.require("the controller")


@pytest.mark.parametrize("value, unlocked", [
    ("1", True), ("true", True), ("all", True), ("ray", True), ("cloudpickle,ray", True), ("Ray", True),
    ("cloudpickle", False), ("0", False), ("", False),
])
def test_the_opt_in_lets_an_unknown_version_be_tried(installed, monkeypatch, value, unlocked):
    installed("ray", "2.61.0")
    monkeypatch.setenv(_compat.OPT_IN_ENV, value)
    assert ray_compat.RAY.allowed() is unlocked
    if unlocked:
        ray_compat.RAY.require("the controller")
    else:
        with pytest.raises(UnsupportedVersionError):
            ray_compat.RAY.require("the controller")


def test_an_unknown_cloudpickle_stops_capture_before_the_cell_runs(installed, monkeypatch):
    from dtrain_magic.notebook.capture import capture

    installed("cloudpickle", "9.0.0")
    namespace: dict = {}
    cell = "RAN = True\ndef train(ctx):\n    return 1\n"
    with pytest.raises(UnsupportedVersionError, match="cloudpickle 9.0.0"):
        capture(cell, namespace)
    assert "RAN" not in namespace
    monkeypatch.setenv(_compat.OPT_IN_ENV, "cloudpickle")
    payload, _ = capture(cell, namespace)
    assert namespace["RAN"] and payload.load()(None) == 1


def test_cloudpickle_code_reducer_keeps_the_cells_file_name_and_plain_cloudpickle_without_it(monkeypatch):
    import cloudpickle

    from dtrain_magic import payload as capture

    def f(x):
        return 2 * x

    f.__code__ = f.__code__.replace(co_filename="<ipython-input-7-abc>")
    assert cloudpickle_compat.code_reducer() is not None
    assert cloudpickle.loads(capture.dumps(f)).__code__.co_filename == "<ipython-input-7-abc>"
    monkeypatch.setattr(cloudpickle_compat, "code_reducer", lambda: None)  # an opted-in cloudpickle without one
    capture._pickler_class.cache_clear()
    try:
        g = cloudpickle.loads(capture.dumps(f))
        assert g(3) == 6 and g.__code__.co_filename != "<ipython-input-7-abc>"
    finally:
        capture._pickler_class.cache_clear()


# -- gated niceties: skipped on an unknown version unless opted in ---------------------------------------
def test_mlflow_store_registry_is_not_asked_on_an_unknown_mlflow(installed, monkeypatch):
    installed("mlflow", "3.99.0")
    assert mlflow_compat.has_store_for("foo://x") is None  # creating the run decides; nothing imported


def test_spark_slot_count_is_skipped_on_an_unknown_pyspark(installed, monkeypatch):
    class Unreachable:
        def __getattr__(self, name):
            raise AssertionError("the JVM was asked")

    installed("pyspark", "4.4.0")
    assert spark_compat.task_slots(Unreachable()) is None
    monkeypatch.setenv(_compat.OPT_IN_ENV, "pyspark")
    assert spark_compat.task_slots(Unreachable()) is None  # asked, failed: cannot tell


def test_spark_context_stopped_and_default_session_without_a_session():
    assert spark_compat.context_stopped(types.SimpleNamespace(_jsc=None)) is True
    assert spark_compat.context_stopped(types.SimpleNamespace(_jsc=object())) is False
    assert spark_compat.context_stopped(types.SimpleNamespace()) is False  # renamed: taken as running
    pytest.importorskip("pyspark")
    assert spark_compat.default_session() is None  # no SparkSession in this process (no JVM started)


def test_aborting_a_ray_train_controller_after_ray_shut_down_asks_nothing_of_ray():
    """At exit after Ray's own exit hook (or the user's ray.shutdown()), an abort must not call Ray: Ray's
    auto-init would start a new local Ray while the interpreter exits."""
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized()

    asked = []

    class Controller:
        @property
        def abort(self):
            asked.append("abort")
            raise RuntimeError("a dead actor")  # (before ray.get, which would auto-init Ray here)

    assert ray_compat.abort(Controller(), wait_s=0.0) is True
    assert asked == [] and not ray.is_initialized()


class _StartingActor:
    """An actor handle whose ``__ray_ready__`` call answers after ``answers_after`` polls (never: None)."""

    def __init__(self, gcs_states: list, answers_after: int | None = None):
        self.gcs_states, self.answers_after, self.polls = gcs_states, answers_after, 0

    @property
    def __ray_ready__(self):
        return types.SimpleNamespace(remote=lambda: "ready-ref")


@pytest.fixture
def starting(monkeypatch):
    """`ray_compat.reach` against a `_StartingActor`: ray.wait polls it, the GCS's view comes from its list."""
    ray = pytest.importorskip("ray")

    def wait(refs, timeout):
        actor.polls += 1
        return (refs, []) if actor.answers_after is not None and actor.polls > actor.answers_after else ([], refs)

    def gcs_state(_):
        states = actor.gcs_states
        return states[min(actor.polls, len(states)) - 1]

    actor = None

    def make(gcs_states, answers_after=None):
        nonlocal actor
        actor = _StartingActor(gcs_states, answers_after)
        return actor

    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray_compat, "_gcs_actor_state", gcs_state)
    return make


def test_a_controller_the_gcs_has_alive_but_this_driver_cannot_reach_is_a_clear_error(starting):
    """The Ray core fault seen after Ray Data and Spark runs in one kernel: the GCS has the new controller ALIVE,
    this driver is never told, its calls wait forever. After the grace the run fails, saying so and what to do."""
    actor = starting(["PENDING_CREATION", "ALIVE"])
    with pytest.raises(ray_compat.DriverLostActors, match="Ray Train did not start.*Restart the kernel"):
        ray_compat.reach(actor, grace_s=0.0)
    assert actor.polls >= 3  # pending first: the grace counts from when the GCS says ALIVE


def test_a_controller_still_being_created_is_waited_for_and_a_cancel_ends_the_wait(starting):
    actor = starting(["PENDING_CREATION"] * 5 + ["ALIVE"], answers_after=6)
    assert ray_compat.reach(actor, grace_s=0.0) is True  # the GCS said ALIVE once, and the driver heard it
    actor = starting(["PENDING_CREATION"])
    assert ray_compat.reach(actor, cancelled=lambda: actor.polls >= 2, grace_s=0.0) is False


def test_a_driver_that_lost_its_actors_is_one_failure_in_its_own_words():
    from dtrain_magic.launchers.ray.diagnostics import failures_from

    [failure] = failures_from(ray_compat.DriverLostActors("Ray Train did not start: ... Restart the kernel"))
    assert failure.rank is None and failure.reason == "Ray Train did not start: ... Restart the kernel"


def test_ipykernel_subshells_only_on_a_known_ipykernel(installed, monkeypatch):
    kernel = types.SimpleNamespace(_supports_kernel_subshells=True)
    installed("ipykernel", "7.4.0")
    assert ipykernel_compat.supports_subshells(kernel) is True
    assert ipykernel_compat.supports_subshells(types.SimpleNamespace()) is False
    installed("ipykernel", "8.0.0")
    assert ipykernel_compat.supports_subshells(kernel) is False
    monkeypatch.setenv(_compat.OPT_IN_ENV, "ipykernel")
    assert ipykernel_compat.supports_subshells(kernel) is True
    comm = types.SimpleNamespace()
    ipykernel_compat.route_comm(comm, "sub-1")
    assert comm._reply_subshell_for({"x": 1}, None) == "sub-1"


# -- fallback niceties: used when the attribute is there ---------------------------------------------------
def test_mlflow_one_sample_is_published_only_when_none_was():
    calls = []

    class Monitor:
        mlflow_logger = types.SimpleNamespace(flush=lambda: calls.append("flush"))

        def collect_metrics(self):
            calls.append("collect")

        def aggregate_metrics(self):
            return {"cpu": 1.0}

        def publish_metrics(self, metrics):
            calls.append(("publish", metrics))

    never = Monitor()
    never._logging_step = 0
    mlflow_compat.publish_one_sample_if_none(never)
    assert calls == ["collect", ("publish", {"cpu": 1.0}), "flush"]
    calls.clear()
    published = Monitor()
    published._logging_step = 3
    mlflow_compat.publish_one_sample_if_none(published)
    mlflow_compat.publish_one_sample_if_none(Monitor())  # attribute gone: nothing extra
    assert calls == []


def test_deepspeed_zero3_attributes_fall_back_to_a_plain_parameter():
    plain = types.SimpleNamespace()
    zero3 = types.SimpleNamespace(ds_id=4, ds_shape=(3, 5))
    assert not deepspeed_compat.is_partitioned(plain) and deepspeed_compat.full_shape(plain) is None
    assert deepspeed_compat.is_partitioned(zero3) and deepspeed_compat.full_shape(zero3) == (3, 5)



def test_deepspeed_zero3_fp32_clones_are_replaced_by_their_partitions_and_anything_else_is_left():
    """DeepSpeed 0.19 clones fp32 partitions it means to step in place (a torch.device compared with a str)."""
    import torch

    flat = torch.arange(12, dtype=torch.float32)
    lp = [flat.narrow(0, 0, 8), flat.narrow(0, 8, 4), torch.zeros(2, dtype=torch.bfloat16), flat.narrow(0, 0, 4)]
    hp = [lp[0].clone(), lp[1].clone(), torch.zeros(2), lp[3].clone() + 1]  # same, same, a real master, differs
    for index, tensor in enumerate(hp):
        tensor.ds_id = f"{index}_{index}"
    inner = torch.optim.Adam([torch.zeros(1, requires_grad=True)])
    stage3 = types.SimpleNamespace(fp32_partitioned_groups_flat=hp, fp16_partitioned_groups_flat=lp, optimizer=inner,
                                   offload_optimizer=False, swap_optimizer=False)
    assert deepspeed_compat.share_fp32_partitions(stage3) == 12 * 4
    assert stage3.fp32_partitioned_groups_flat[0] is lp[0] and stage3.fp32_partitioned_groups_flat[1] is lp[1]
    assert lp[0].ds_id == "0_0" and lp[0].requires_grad
    assert stage3.fp32_partitioned_groups_flat[2].dtype == torch.float32  # bf16 partitions keep their fp32 master
    assert stage3.fp32_partitioned_groups_flat[3] is not lp[3]
    assert deepspeed_compat.share_fp32_partitions(stage3) == 0  # once shared, nothing more
    offloaded = types.SimpleNamespace(**{**vars(stage3), "offload_optimizer": True})
    assert deepspeed_compat.share_fp32_partitions(offloaded) == 0
    assert deepspeed_compat.share_fp32_partitions(types.SimpleNamespace(optimizer=inner)) == 0  # not ZeRO-3

def test_torch_build_lock_name_is_the_one_torch_uses():
    import inspect

    from torch.utils import cpp_extension

    assert f"FileBaton(os.path.join(build_directory, '{torch_compat.EXTENSION_BUILD_LOCK}'))" in inspect.getsource(
        cpp_extension
    )


def test_a_ray_run_without_datasets_gets_a_shard_provider_that_starts_no_actor():
    """Ray Train's own DatasetsCallback starts a DatasetManager actor per run, datasets or not: replaced for runs
    without any, its provider answers ``get_dataset_shard`` with the flag that gives a run a dataset."""
    pytest.importorskip("ray.train")
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

    replacement = ray_compat._no_datasets_callback()
    assert replacement is not None and replacement.__base__ is DatasetsCallback
    providers = replacement.before_init_train_context(object.__new__(replacement), [object(), object()])
    assert [type(p) for p in providers["dataset_shard_provider"]] == [ray_compat.NoDatasetShards] * 2
    with pytest.raises(KeyError, match=r"get_dataset_shard\('train'\): this run was given no Ray Dataset; pass it "
                                       r"with --data train="):
        providers["dataset_shard_provider"][0].get_dataset_shard(types.SimpleNamespace(dataset_name="train"))

    import ray.train

    trainer = ray_compat.abortable_trainer_class()

    def callbacks(**datasets):
        made = trainer(lambda config: None, scaling_config=ray.train.ScalingConfig(num_workers=2), datasets=datasets,
                       run_config=ray.train.RunConfig(name="unit", storage_path="/tmp/dtrain-unit-unused"))
        return [type(callback).__name__ for callback in made._create_default_callbacks()]

    assert "NoDatasetsCallback" in callbacks() and "DatasetsCallback" not in callbacks()
    with_data = callbacks(train=lambda: None)  # (a Dataset factory: no Ray started for it)
    assert "DatasetsCallback" in with_data and "NoDatasetsCallback" not in with_data


def test_the_controller_gets_the_given_ray_train_defaults_unless_the_notebook_set_them(monkeypatch):
    """A one-machine Ray's defaults (`ONE_MACHINE_RAY_TRAIN_ENV`, and a one-node Ray's: no preemption watcher) reach
    the controller's environment, which Ray Train hands on to the workers; a value the notebook's environment sets
    is kept."""
    import ray
    import ray.train

    from dtrain_magic.launchers.ray.driver import ONE_MACHINE_RAY_TRAIN_ENV, ONE_NODE_RAY_TRAIN_ENV

    given: dict = {}

    def remote(**options):
        given.update(options["runtime_env"]["env_vars"])
        raise RuntimeError("no controller started in a unit test")

    monkeypatch.setattr(ray, "remote", remote)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(get_node_id=lambda: "node"))
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "3")
    monkeypatch.delenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", raising=False)
    def controller_env(defaults) -> dict:
        given.clear()
        trainer = ray_compat.abortable_trainer_class(defaults)(
            lambda config: None, scaling_config=ray.train.ScalingConfig(num_workers=2),
            run_config=ray.train.RunConfig(name="unit", storage_path="/tmp/dtrain-unit-unused"))
        with pytest.raises(RuntimeError, match="no controller started"):
            trainer._initialize_and_run_controller()
        return dict(given)

    one_node = controller_env(ONE_NODE_RAY_TRAIN_ENV)
    assert one_node["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "3"  # the notebook's own
    assert one_node["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "0"
    # several nodes on this machine (a notebook's own Ray of raylets): the watcher sees their drains
    assert "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER" not in controller_env(ONE_MACHINE_RAY_TRAIN_ENV)
    assert "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER" not in controller_env(None)  # a cluster's: Ray's own defaults


def test_a_ray_train_controller_that_cannot_be_killed_is_a_warning(monkeypatch, caplog):
    """Its workers' CPUs may stay held: the user hears it once, at WARNING (issue #35), and the abort goes on."""
    ray = pytest.importorskip("ray")

    class Controller:
        class abort:  # noqa: N801 - stands for the actor method
            @staticmethod
            def remote():
                return "ref"

    def timed_out(ref, timeout):
        raise ray.exceptions.GetTimeoutError("still aborting")

    def refuse(actor, no_restart):
        raise RuntimeError("the GCS does not answer")

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get", timed_out)
    monkeypatch.setattr(ray, "kill", refuse)
    with caplog.at_level("WARNING", logger="dtrain_magic._compat.ray"):
        assert ray_compat.abort(Controller(), wait_s=0.0) is False
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "could not kill Ray Train's run controller" in caplog.text and "the GCS does not answer" in caplog.text


def test_a_zero_checkpoints_ranks_are_its_optimizer_partition_files(tmp_path):
    """How many ranks wrote a DeepSpeed tag folder (an --elastic resize converts it when that differs): the ranks of
    its ZeRO optimizer files, bf16's too; none (ZeRO-0: whole states) is None."""
    (tmp_path / "mp_rank_00_model_states.pt").touch()
    assert deepspeed_compat.saved_dp_world(str(tmp_path)) is None
    for rank in (0, 1, 2):
        (tmp_path / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").touch()
        (tmp_path / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").touch()  # ZeRO-3's per-rank model files
    assert deepspeed_compat.saved_dp_world(str(tmp_path)) == 3
