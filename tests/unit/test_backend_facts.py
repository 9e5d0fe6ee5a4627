"""What used to be decided by ``backend == "ray"`` is asked of the backend's facts (`dtrain_magic.backends`): a
backend registered under another name with Ray's facts gets Ray's behaviour, and one without them does not
(issue #35). Pure: nothing starts."""

from __future__ import annotations

import numpy as np
import pytest

from dtrain_magic.backends import Backend, Ray
from dtrain_magic.config import RunConfig
from dtrain_magic.driver.data_plan import resolve
from dtrain_magic.driver.plan import check_payload
from dtrain_magic.errors import ConfigError
from dtrain_magic.integrations import in_ray_train
from dtrain_magic.payload import Payload
from dtrain_magic.registry import BACKENDS, STRATEGIES


class LikeRay(Ray):
    name = "likeray"


class Plain(Backend):
    name = "plain"


@pytest.fixture
def registered():
    BACKENDS.register("likeray", LikeRay)  # facts only: nothing here launches
    BACKENDS.register("plain", Plain)
    yield
    BACKENDS.unregister("likeray")
    BACKENDS.unregister("plain")


def test_data_routes_follow_the_facts_not_the_name(registered):
    namespace = {"frame": {"x": np.arange(8.0)}}
    for backend, in_store in (("likeray", True), ("plain", False), ("ray", True), ("local", False)):
        source = resolve(RunConfig(backend=backend, data={"a": "frame"}), True, namespace, (), "train(ctx)").sources[0]
        assert source.needs_files(backend) is not in_store, backend
        assert ("Ray's object store" in source.route(backend)) is in_store, backend


def test_a_ray_train_loop_and_the_ray_train_hooks_follow_the_facts(registered):
    payload = Payload(b"", "loop", False, call_text="loop()", uses_ray_train=True)
    check_payload(RunConfig(backend="likeray"), payload)
    with pytest.raises(ConfigError, match="run it with --backend ray or likeray, where it runs unchanged"):
        check_payload(RunConfig(backend="plain"), payload)
    assert in_ray_train("likeray") and in_ray_train("ray") and not in_ray_train("plain")
    assert not in_ray_train("registered_only_in_the_notebook")  # a worker's registry may not know it


def test_the_defaults_are_the_first_registered_entries():
    assert (RunConfig().backend, RunConfig().strategy) == (BACKENDS.names()[0], STRATEGIES.names()[0])
    assert BACKENDS.load("ray").ray_train and BACKENDS.facts("ray") is Ray  # the launcher inherits its facts
