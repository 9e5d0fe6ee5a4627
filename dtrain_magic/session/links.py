"""The session's listener in the notebook (`RankLinks`): the connection each rank reads its commands from.

Authenticated like the run's channel (`channel.AuthenticatedListener`: a fresh secret, loopback unless the backend's
workers are elsewhere). A rank connects once, says `SessionReady`, then only reads; its connection closing is the
rank gone.
"""

from __future__ import annotations

import pickle
import threading
from typing import Any, Iterable

from ..channel import AuthenticatedListener, Message, decode
from ..errors import log_dropped
from .protocol import SessionReady


class RankLinks:
    """The session's listener in the notebook: each rank connects (`SessionReady`), then reads its commands here."""

    def __init__(self, host: str, world_size: int):
        self.world_size = world_size
        self.ready: dict[int, SessionReady] = {}
        self.gone: set[int] = set()  # ranks whose connection closed
        self.all_ready = threading.Event()
        self._conns: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._listener = AuthenticatedListener(host, self._serve, "dtrain-session")
        self.address = (host, self._listener.port, self._listener.authkey)

    def _serve(self, conn: Any, serial: int) -> None:
        try:
            ready = decode(conn.recv())
        except Exception as exc:  # not a rank of this session, or the listener closed
            log_dropped(__name__, "_serve", exc)
            return  # (the listener closes conn when this returns)
        with self._lock:
            if not isinstance(ready, SessionReady) or ready.rank in self._conns:
                return
            self._conns[ready.rank], self.ready[ready.rank] = conn, ready
            if len(self._conns) >= self.world_size:
                self.all_ready.set()
        try:
            conn.recv()  # a rank never sends more here: this returns (EOF) when it ends or dies
        except (EOFError, OSError) as exc:
            log_dropped(__name__, "_serve", exc)
        with self._lock:
            self.gone.add(ready.rank)

    def send(self, ranks: Iterable[int], message: Message) -> None:
        """``message`` to each rank in ``ranks``, pickled once for all of them (a push of a large value is not
        pickled again per rank); a rank's ``recv`` unpickles it as any message."""
        data = pickle.dumps(message.wire(), protocol=pickle.HIGHEST_PROTOCOL)
        for rank in ranks:
            with self._lock:
                conn = self._conns.get(rank)
            if conn is None:
                continue
            try:
                conn.send_bytes(data)
            except (OSError, ValueError) as exc:  # it is gone: the session sees it as lost
                log_dropped(__name__, "send", exc)
                with self._lock:
                    self.gone.add(rank)

    def close(self) -> None:
        self._listener.close()
