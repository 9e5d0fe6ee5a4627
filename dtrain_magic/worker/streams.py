"""The worker's ``sys.stdout``/``sys.stderr`` while the user's function runs: each line goes to the notebook."""

from __future__ import annotations

import io

from ..channel import Output, WorkerLink


class ChannelStream(io.TextIOBase):
    """A text stream that sends each complete line to the notebook, tagged with rank and stream name."""

    def __init__(self, link: WorkerLink, rank: int, name: str):
        self._link, self._rank, self._name, self._buffer = link, rank, name, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._buffer += text
        if "\n" in self._buffer:
            complete, _, self._buffer = self._buffer.rpartition("\n")
            self._link.send(Output(self._rank, self._name, complete + "\n"))
        return len(text)

    def flush(self) -> None:
        if self._buffer:
            self._link.send(Output(self._rank, self._name, self._buffer))
            self._buffer = ""

    def isatty(self) -> bool:
        return False
