"""The channel between the notebook (driver) and its workers, whatever the backend.

Workers connect back to a listener in the notebook process and send small messages: output lines,
metrics, status, their result or their error. It is the standard library's authenticated
``multiprocessing.connection`` (HMAC challenge with a per-run secret), so only this run's workers can
talk to it. It listens on 127.0.0.1 unless a launcher asks for a cluster-reachable address.
"""

from __future__ import annotations

import queue
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Callable

# Message kinds (first element of each tuple a worker sends).
HELLO = "hello"  # (HELLO, rank, {"pid":..., "host":...})
OUTPUT = "out"  # (OUTPUT, rank, "stdout"|"stderr", text)
METRIC = "metric"  # (METRIC, rank, step, {name: value}, timestamp_ms)
STATUS = "status"  # (STATUS, rank, state, detail)
RESULT = "result"  # (RESULT, rank, pickled_value)
ERROR = "error"  # (ERROR, rank, summary, traceback_text, unix_time)
TOTAL = "total"  # (TOTAL, rank, total_steps)


@dataclass(frozen=True)
class ChannelAddress:
    """Where workers connect, and the secret that proves they belong to this run."""

    host: str
    port: int
    authkey: bytes

    def __repr__(self) -> str:  # never show the secret
        return f"ChannelAddress({self.host}:{self.port})"


class AuthenticatedListener:
    """A ``multiprocessing.connection`` listener with a fresh secret; every accepted connection is
    served by ``serve(conn, serial)`` in a thread of its own (serials count from 1, in accept order)."""

    def __init__(self, host: str, serve: Callable[[Connection, int], None], name: str):
        self.authkey = secrets.token_bytes(32)
        self._listener = Listener((host, 0), authkey=self.authkey)
        self.host, self.port = host, self._listener.address[1]
        self._serve, self._name = serve, name
        self.closed = threading.Event()
        self._lock = threading.Lock()
        self._connections: list[Connection] = []
        self._servers: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True)
        self._acceptor.start()

    def _accept_loop(self) -> None:
        while not self.closed.is_set():
            try:
                conn = self._listener.accept()
            except Exception:  # closed listener, or a client that failed authentication
                if self.closed.is_set():
                    return
                continue
            with self._lock:
                self._connections.append(conn)
                serial = len(self._connections)
                server = threading.Thread(target=self._serve, args=(conn, serial), name=self._name, daemon=True)
                self._servers.append(server)
            server.start()

    def join_servers(self, timeout: float) -> None:
        """Wait for every connection's server thread to end (its peer closed the connection)."""
        with self._lock:
            servers = list(self._servers)
        for server in servers:
            server.join(timeout)

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        try:
            # accept() does not return when the socket is closed from another thread: wake it with a
            # connection of our own, whose failed authentication the accept loop ignores.
            socket.create_connection((self.host, self.port), timeout=1).close()
        except OSError:
            pass
        self._acceptor.join(2)
        try:
            self._listener.close()
        except Exception:
            pass
        with self._lock:
            for conn in self._connections:
                try:
                    conn.close()
                except Exception:
                    pass


class Channel:
    """Driver side: accepts worker connections and funnels their messages into one queue."""

    def __init__(self, host: str = "127.0.0.1"):
        # (connection serial or None for the driver's own messages, message)
        self.messages: "queue.Queue[tuple[int | None, tuple]]" = queue.Queue()
        self._delivered: set[int] = set()  # connections get() has returned a message from
        self._retired: set[int] = set()
        self.last_serial: int | None = None
        self._listener = AuthenticatedListener(host, self._read_loop, "dtrain-channel-read")
        self.address = ChannelAddress(host, self._listener.port, self._listener.authkey)

    def _read_loop(self, conn: Connection, serial: int) -> None:
        try:
            while True:
                self.messages.put((serial, conn.recv()))
        except (EOFError, OSError):
            pass
        except Exception as exc:  # unpicklable message: report rather than lose it silently
            self.messages.put((serial, (ERROR, None, f"unreadable message from a worker: {exc!r}", "", time.time())))
        finally:
            conn.close()

    def put(self, message: tuple) -> None:
        """Inject a message from the driver side (a launcher's captured process output, say)."""
        self.messages.put((None, message))

    def get(self, timeout: float) -> tuple | None:
        """The next message (None after ``timeout``), skipping those of retired connections."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                serial, message = self.messages.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if serial in self._retired:
                continue
            if serial is not None:
                self._delivered.add(serial)
            self.last_serial = serial
            return message

    def pending(self) -> bool:
        return not self.messages.empty()

    def retire_earlier_connections(self, keep_last: bool = True) -> None:
        """Ignore from now on every connection that delivered a message so far (but the last one's,
        with ``keep_last``).

        Called when workers restart: what the previous attempt's workers still send (a peer's
        "connection reset" error, say) must not count against the new attempt.
        """
        self._retired |= self._delivered - ({self.last_serial} if keep_last else set())

    def wait_readers(self, timeout: float) -> None:
        """Wait until every connected worker has closed its connection (its messages are all queued)."""
        self._listener.join_servers(timeout)

    def close(self) -> None:
        self._listener.close()

    def __enter__(self) -> "Channel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class WorkerLink:
    """Worker side: one connection back to the notebook; thread-safe ``send``."""

    def __init__(self, address: ChannelAddress, rank: int):
        self.rank = rank
        self._conn = Client((address.host, address.port), authkey=address.authkey)
        self._lock = threading.Lock()
        self._broken = False

    def send(self, message: tuple) -> None:
        if self._broken:
            return
        with self._lock:
            try:
                self._conn.send(message)
            except (OSError, EOFError):
                # The notebook went away (run cancelled): keep training code from crashing on a log call.
                self._broken = True

    def close(self) -> None:
        with self._lock:
            try:
                self._conn.close()
            except Exception:
                pass
