"""The MLflow tracking URI: where it comes from, whether MLflow can use it, and what a SQLite store says.

Everything here runs before anything is launched, and never creates a database, an experiment or a run.
"""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
from typing import Any
from urllib.parse import quote, urlsplit

from .._compat import mlflow as mlflow_compat
from ..config import RunConfig, default_tracking_uri, redact_uri
from ..errors import ConfigError
from .preload import wait_for_preload

# An http(s) tracking server must answer within this long; MLflow itself retries a dead one for minutes.
PROBE_TIMEOUT_S = 3.0
ALLOWED_URIS = (
    "sqlite:///path/to/mlflow.db, a directory (a path or file:///path; MLflow 3 wants MLFLOW_ALLOW_FILE_STORE=true), "
    "or http(s)://host:port of an MLflow server"
)
NOTHING_LAUNCHED = "Nothing was launched and no MLflow run was created."
WORKERS_STOPPED = "The workers, started while MLflow opened the run, were stopped; no MLflow run was created."
_PLAIN_SCHEMES = {"", "file", "sqlite", "http", "https"}  # MLflow always has these; others: ask its registry


def resolve_tracking_uri(config: RunConfig) -> str:
    """``--tracking-uri``, else ``MLFLOW_TRACKING_URI``, else ``sqlite:///./mlflow.db``."""
    return config.tracking_uri or default_tracking_uri()


def check_tracking_uri(config: RunConfig, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """The tracking URI, or a short `ConfigError` when MLflow cannot use it: an unknown scheme, or an
    http(s) server that does not answer within ``timeout_s``. Creates nothing (no database, no run). A deleted
    experiment in a SQLite store is the caller's to refuse (`deleted_experiment_error`): it reads the store's
    `sqlite_experiment_stage` once per run, for this and for when the workers may start."""
    uri = resolve_tracking_uri(config)
    bare = uri.strip().lower()
    scheme = bare if bare in {"databricks", "databricks-uc", "uc"} else urlsplit(uri).scheme.lower()
    if scheme not in _PLAIN_SCHEMES and not _mlflow_has_store_for(uri):
        raise tracking_uri_error(config, f"MLflow has no tracking store for the scheme {scheme + '://'!r}")
    if scheme in ("http", "https"):
        problem = _probe_http(uri, timeout_s)
        if problem:
            raise tracking_uri_error(
                config, f"no working MLflow server there ({problem})", "Start one (`mlflow server --port PORT`) or use"
            )
    return uri


def tracking_uri_error(config: RunConfig, problem: str, fix: str = "Use") -> ConfigError:
    """``--tracking-uri: <problem>`` naming the URI (credentials removed), where it came from, and what works."""
    uri = redact_uri(resolve_tracking_uri(config))
    origin = "" if config.tracking_uri else " (from $MLFLOW_TRACKING_URI)"
    return ConfigError("--tracking-uri", f"{uri!r}{origin}: {problem}. {fix} {ALLOWED_URIS}. {NOTHING_LAUNCHED}")


def deleted_experiment_error(config: RunConfig, uri: str) -> ConfigError:
    return ConfigError(
        "--experiment",
        f"the experiment {config.experiment!r} was deleted in {redact_uri(uri)}; restore it "
        f"(`mlflow experiments restore`) or choose another name. {NOTHING_LAUNCHED}",
    )


def sqlite_experiment_stage(uri: str, experiment: str) -> str | None:
    """What a plain ``sqlite:///path`` store says of ``experiment``, read without importing MLflow (which
    takes seconds): ``"active"``, ``"deleted"``, ``"absent"`` (no such experiment or no database yet:
    MLflow creates them), or None when this cannot tell (another kind of store, a file this user cannot
    write, not MLflow's schema). Read-only: creates nothing."""
    if not uri.startswith("sqlite:///") or "?" in uri:
        return None
    path = os.path.abspath(os.path.expanduser(uri[len("sqlite:///"):]))  # sqlite:////abs or sqlite:///relative
    folder = os.path.dirname(path)
    if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):  # SQLite writes its journal beside the file
        return None
    if not os.path.exists(path):
        return "absent"
    if not os.access(path, os.R_OK | os.W_OK):
        return None
    try:
        with contextlib.closing(sqlite3.connect(f"file:{quote(path)}?mode=ro", uri=True, timeout=2.0)) as db:
            row = db.execute("SELECT lifecycle_stage FROM experiments WHERE name = ?", (experiment,)).fetchone()
    except sqlite3.Error:
        return None
    if row is None:
        return "absent"
    return row[0] if row[0] in ("active", "deleted") else None


def _mlflow_has_store_for(uri: str) -> bool:
    wait_for_preload()
    return mlflow_compat.has_store_for(uri) is not False  # None: cannot tell here, creating the run decides


def _probe_http(uri: str, timeout_s: float) -> str | None:
    """Why nothing answers HTTP at ``uri`` within ``timeout_s`` (one request, no retry), or None.

    Any answer below 500 counts, even 401 or 404: creating the run then says what is wrong with it. A 5xx
    (a proxy in front of a dead server, an unhealthy server) does not: MLflow would retry it for minutes.
    """
    import requests

    insecure = os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() in ("true", "1")
    verify: Any = False if insecure else os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH") or True
    cert = os.environ.get("MLFLOW_TRACKING_CLIENT_CERT_PATH") or None
    try:
        answer = requests.get(
            f"{uri.rstrip('/')}/health", timeout=timeout_s, verify=verify, cert=cert, allow_redirects=False
        )
    except requests.exceptions.SSLError as exc:
        return f"TLS failed: {_os_reason(exc)}"
    except requests.exceptions.Timeout:
        return f"no answer within {timeout_s:g} s"
    except (requests.exceptions.RequestException, ValueError) as exc:
        return _os_reason(exc)
    if answer.status_code >= 500:
        return f"/health answers HTTP {answer.status_code} {answer.reason or ''}".rstrip()
    return None


def _os_reason(exc: Exception) -> str:
    """"Connection refused" out of requests' nested "Max retries exceeded ... [Errno 111] ..." text."""
    found = re.search(r"\[(?:Errno|SSL[^\]]*)[^\]]*\]\s*([^'\")]+)", str(exc))
    return found.group(1).strip().rstrip(".:") if found else type(exc).__name__
