"""docs/ARCHITECTURE.md's interface lists name every public member of the interfaces it lists, so they cannot drift
from the code (issue #35: claim_standby, keep_warm, release_standby, workers_share_files were missing)."""

import dataclasses
import re
from pathlib import Path

import pytest

from dtrain_magic.backends import Backend
from dtrain_magic.driver.observer import RunObserver
from dtrain_magic.launchers.base import Launcher, RunningJob
from dtrain_magic.strategies.base import Strategy
from dtrain_magic.worker.job import WorkerJob

TEXT = (Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md").read_text()


def public_members(cls: type) -> list[str]:
    return [name for name, value in vars(cls).items() if not name.startswith("_")
            and (callable(value) or isinstance(value, (property, classmethod, staticmethod)))]


@pytest.mark.parametrize("cls", [Backend, Launcher, RunningJob, Strategy, RunObserver])
def test_every_public_member_of_an_interface_is_in_the_architecture_doc(cls):
    missing = [name for name in public_members(cls) if not re.search(rf"\b{name}\b", TEXT)]
    assert not missing, f"docs/ARCHITECTURE.md does not name {cls.__name__}'s {', '.join(missing)}"


def test_every_field_of_a_worker_job_is_in_the_architecture_doc():
    missing = [f.name for f in dataclasses.fields(WorkerJob) if not re.search(rf"\b{f.name}\b", TEXT)]
    assert not missing, f"docs/ARCHITECTURE.md does not name WorkerJob's {', '.join(missing)}"
