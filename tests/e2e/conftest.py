"""Fixtures of the e2e tests."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class HeadlessNotebook:
    path: Path  # the notebook nbconvert executed and saved
    tag: str  # in the environment of the kernel and everything it started (tests/leftovers.py)
    executed_s: float


@pytest.fixture(scope="session")
def headless_notebook(tmp_path_factory) -> HeadlessNotebook:
    """The notebook of test_saved_notebook.py (the panel on, one run) executed once by ``jupyter nbconvert
    --execute``: its size and saved state are checked there, what JupyterLab draws of it in test_browser.py."""
    from test_saved_notebook import execute_headless

    from leftovers import new_tag, tagged_env

    tag = new_tag()
    started = time.monotonic()
    path = execute_headless(tmp_path_factory.mktemp("headless"), tagged_env(tag))
    return HeadlessNotebook(path, tag, time.monotonic() - started)
