"""The default checkpoint store: numbered saves, saves to a named directory, and where they live."""

import os

import pytest

from dtrain_magic.config import RunConfig
from dtrain_magic.errors import ConfigError
from dtrain_magic.worker.checkpoints import CheckpointStore, run_checkpoint_root, storage_path


def test_numbered_saves_and_latest(tmp_path):
    store = CheckpointStore(str(tmp_path / "run"))
    assert store.latest() is None
    first = store.next_dir()
    store.saved(first)
    second = store.next_dir()
    assert os.path.basename(first) == "checkpoint_000000" and os.path.basename(second) == "checkpoint_000001"
    assert oct(os.stat(tmp_path / "run").st_mode & 0o777) == "0o700"  # private to the user
    assert store.latest() == first  # the second is not complete yet: a crash mid-save is ignored
    store.saved(second)
    assert store.latest() == second


def test_a_save_to_a_named_directory_is_the_latest_too(tmp_path):
    # ctx.save_checkpoint("ckpt") then ctx.load_checkpoint() restores "ckpt", as on Ray Train.
    store = CheckpointStore(str(tmp_path / "run"))
    store.saved(store.next_dir())
    named = tmp_path / "ckpt"
    named.mkdir()
    store.saved(str(named))
    assert store.latest() == str(named)
    later = store.next_dir()
    store.saved(later)
    assert store.latest() == later


def test_a_named_directory_removed_later_falls_back_to_the_numbered_ones(tmp_path):
    store = CheckpointStore(str(tmp_path / "run"))
    numbered = store.next_dir()
    store.saved(numbered)
    named = tmp_path / "gone"
    named.mkdir()
    store.saved(str(named))
    (named / ".complete").unlink()
    assert store.latest() == numbered


def test_the_root_is_the_same_on_every_backend(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert storage_path(None) == str(tmp_path / "dtrain_runs")
    assert run_checkpoint_root(None, "abc") == str(tmp_path / "dtrain_runs" / "dtrain_abc")
    assert run_checkpoint_root("rel", "abc") == str(tmp_path / "rel" / "dtrain_abc")
    assert storage_path("s3://bucket/x") == "s3://bucket/x"


@pytest.mark.parametrize("backend", ["local", "spark"])
def test_storage_urls_are_for_ray_only(backend):
    RunConfig(backend=backend, storage="/shared/ckpts", use_gpu=False)
    with pytest.raises(ConfigError) as info:
        RunConfig(backend=backend, storage="s3://bucket/ckpts", use_gpu=False)
    assert info.value.flag == "--storage" and "--backend ray" in str(info.value)
    RunConfig(backend="ray", storage="s3://bucket/ckpts", use_gpu=False)
