"""What a session says about itself: the line that opened it, its status, the record of its cells, why a rank cannot
take a command. Text only, from what the `Session` exposes."""

from __future__ import annotations

import time
from typing import Any, Iterable, Mapping

from ..config import RunConfig
from ..driver.observer import plan_with_backend
from .options import start_line
from .report import duration, listed, who


def held_text(described: str, config: RunConfig, idle_timeout_s: float | None) -> str:
    """What the session holds and until when, for the cell that started it."""
    until = ("until it is stopped" if not idle_timeout_s else
             f"until it is idle for {duration(idle_timeout_s)} (--idle-timeout S; 0: until stopped)")
    return (f"session open: {plan_with_backend(described, config)}; strategy {config.strategy}, "
            f"{config.precision}; held {until}. %%ranks runs a cell on its ranks; %distribute_session stop "
            "frees them now")


def status_text(session: Any) -> str:
    """``session`` in a few lines: where its ranks are and what each does, its MLflow run, how long it is held."""
    if session.state != "open":
        return f"dtrain_magic session: {session.state}{': ' + session.ended if session.ended else ''}"
    config, idle = session.config, session.idle_timeout_s
    lines = [f"dtrain_magic session: open, {plan_with_backend(session.described, config)}; strategy "
             f"{config.strategy}, {config.precision}"]
    for rank in range(session.world_size):
        ready = session.links.ready.get(rank)
        where = f"pid {ready.pid} on {ready.host}" if ready else "not connected"
        doing = session.doing(rank)
        lines.append(f"  rank {rank}: {where}, {f'busy with {doing}' if doing else 'idle'}")
    lines.append(f"  cells run: {session.cells_run}; MLflow run {session.run_id} ({session.tracking_uri})")
    if idle:
        at = time.strftime("%H:%M:%S", time.localtime(session.idle_since + idle))
        lines.append(f"  released if idle until {at} (--idle-timeout {idle:g}); %distribute_session stop frees it now")
    lines.append(f"  equivalent: {start_line(config, idle)}")
    return "\n".join(lines)


def busy_text(doing: Mapping[int, str]) -> str:
    """Ranks (rank → the command each still runs) that cannot take a new one, and what the user can do."""
    busy = sorted(doing)
    return (f"{who(busy)} still run{'s' if len(busy) == 1 else ''} "
            f"{', '.join(sorted(set(doing.values())))}: interrupted, but not stopped (blocked outside Python, e.g. in "
            "a collective). Wait for it to end (the session says when), or %distribute_session restart (every rank's "
            "state is lost) or stop")


def cells_text(sources: Iterable[tuple[str, tuple[int, ...], str]], world_size: int) -> str:
    """Every command's source (label, ranks, source) with where it ran, in order (the MLflow run's
    ``session_cells.py``)."""
    parts = []
    for label, ranks, source in sources:
        where = "every rank" if len(ranks) == world_size else f"ranks {listed(ranks)}"
        parts.append(f"# --- {label} on {where}\n{source.strip(chr(10))}\n")
    return "\n".join(parts)
