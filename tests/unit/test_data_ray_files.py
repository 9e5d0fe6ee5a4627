"""`RayLauncher.workers_share_files`: whether a staged ``--data`` copy in this machine's temp dir reaches every Ray
worker (else ``--data-dir`` is required). A stand-in ``ray`` module: the answer is pure logic over what Ray says
(the real Ray on loopback is checked in tests/integration/test_ray.py)."""

from __future__ import annotations

import sys
import types

import pytest

from dtrain_magic.config import RunConfig
from dtrain_magic.launchers.ray.driver import RayLauncher


def fake_ray(here: str, nodes: list[dict] | Exception | None) -> types.ModuleType:
    """A ``ray`` that is connected (``nodes`` given) or not (None), on a node at ``here``."""
    ray = types.ModuleType("ray")
    ray.is_initialized = lambda: nodes is not None

    def list_nodes():
        if isinstance(nodes, Exception):
            raise nodes
        return nodes

    ray.nodes = list_nodes
    ray.util = types.SimpleNamespace(get_node_ip_address=lambda: here)
    return ray


def node(address: str, alive: bool = True) -> dict:
    return {"NodeManagerAddress": address, "Alive": alive}


@pytest.mark.parametrize("nodes, shared", [
    ([node("10.0.0.5")], True),  # one node: this machine
    ([node("10.0.0.5"), node("127.0.0.1")], True),  # a second raylet on this machine's loopback
    ([node("10.0.0.5"), node("10.0.0.6", alive=False)], True),  # a dead node runs no worker
    ([node("10.0.0.5"), node("10.0.0.6")], False),  # a worker node elsewhere: it cannot read our temp dir
    (RuntimeError("GCS unreachable"), False),  # cannot tell: ask for --data-dir
])
def test_a_connected_ray_shares_files_only_when_every_alive_node_is_this_machine(monkeypatch, nodes, shared):
    monkeypatch.setitem(sys.modules, "ray", fake_ray("10.0.0.5", nodes))
    assert RayLauncher().workers_share_files(RunConfig(backend="ray")) is shared


@pytest.mark.parametrize("address, shared", [
    (None, True),  # the local instance a run would start
    ("127.0.0.1:6379", True),
    ("ray://localhost:10001", True),
    ("10.0.0.6:6379", False),
    ("auto", False),  # an existing cluster, wherever its nodes are: not assumed
])
def test_before_connecting_only_a_local_instance_or_a_loopback_address_shares_files(monkeypatch, address, shared):
    monkeypatch.setitem(sys.modules, "ray", fake_ray("10.0.0.5", None))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert RayLauncher().workers_share_files(RunConfig(backend="ray", ray_address=address)) is shared
