"""What a session command's answers mean for the cell: the error it raises (`raise_for`), said once per cause,
with every rank's part and what the user can do next."""

from __future__ import annotations

from typing import Iterable

from ..errors import CellInterrupted, CellTimeout, RankError, WorkerError
from .protocol import FAILED, INTERRUPTED, CellDone

INTERRUPT_WAIT_S = 5.0  # an interrupted rank that has not stopped by then is blocked outside Python


def raise_for(label: str, chosen: tuple[int, ...], done: dict[int, CellDone], stuck: tuple[int, ...],
               why: str | None, timeout: float | None) -> None:
    """The error a command's answers make, if any: failures first, then an interrupt or a timeout."""
    failed = {rank: answer for rank, answer in done.items() if answer.outcome == FAILED}
    stopped = {rank: answer for rank, answer in done.items() if answer.outcome == INTERRUPTED}
    notes = []
    if stopped:
        notes.append("; ".join(f"rank {rank} {answer.summary}" for rank, answer in sorted(stopped.items())))
    if stuck:
        notes.append(stuck_text(stuck, label))
    if failed:
        raise RankError(failures_text(failed) + "".join(f"\n\n{note}" for note in notes) + (
            "" if stuck else "\n\nThe session goes on: its ranks and their state are kept."),
            {rank: (answer.summary, answer.traceback) for rank, answer in failed.items()})
    if why == "interrupt" or stopped or stuck:
        finished = [rank for rank in chosen if rank in done and rank not in stopped]
        text = (f"{label} was interrupted on {who([rank for rank in chosen if rank not in finished])}"
                + (f" ({who(finished)} had finished it)" if finished else ""))
        text += "".join(f"\n{note}" for note in notes)
        if not stuck:
            text += "\nThe session and its state are kept."
        if why == "timeout":
            raise CellTimeout(f"--timeout {timeout:g}: " + text, stuck)
        raise CellInterrupted(text, stuck)


def failures_text(failed: dict[int, CellDone]) -> str:
    """Each failure once: ranks with the same traceback together (``ranks 0, 1 failed: ...``)."""
    groups: dict[tuple[str, str], list[int]] = {}
    for rank, answer in sorted(failed.items()):
        groups.setdefault((answer.summary, answer.traceback), []).append(rank)
    parts = []
    for (said, where), ranks in groups.items():
        parts.append(f"{who(ranks)} failed: {said}" + (f"\n\n{where.rstrip()}" if where else ""))
    return "\n\n".join(parts)


def stuck_text(stuck: tuple[int, ...], label: str) -> str:
    return (f"{who(stuck)} did not stop within {INTERRUPT_WAIT_S:g} s: blocked outside Python, most likely in a "
            "collective (all_reduce, barrier, a DDP backward...) that a rank not running this cell will never join, or "
            f"in a long native call. {'It stays' if len(stuck) == 1 else 'They stay'} busy with {label}; if it ends "
            "later the session goes on. %distribute_session restart starts every rank afresh (their state is lost); "
            "%distribute_session stop frees them.")


def lost_reason(gone: list[int], failures: list, errors: list) -> str:
    if failures:
        first = failures[0]
        who = "a rank" if first.rank is None else f"rank {first.rank}"
        return f"{who} ended: {first.reason}"
    if errors:
        first = min(errors, key=lambda error: error.unix_time)
        return str(WorkerError(first.rank, first.summary)).splitlines()[0]
    if gone:
        return f"{who(gone)} ended (the connection to the notebook closed)"
    return "the backend ended the ranks' launch"


def who(ranks: Iterable[int]) -> str:
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {listed(ranks)}"


def listed(ranks: Iterable[int]) -> str:
    return ", ".join(str(rank) for rank in ranks)


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
