"""The channel between the notebook (driver) and its workers, whatever the backend.

Workers connect back to a listener in the notebook process and send small messages: output lines,
metrics, status, their result or their error. It is the standard library's authenticated
``multiprocessing.connection`` (HMAC challenge with a per-run secret), so only this run's workers can
talk to it. It listens on 127.0.0.1 unless a launcher asks for a cluster-reachable address.

The protocol: every message is one small frozen class below, a subclass of `Message`. A worker sends, in
order: `Hello` once it is connected; `Output` lines as its Python code writes them (a launcher also emits
`Output` for what it reads from a process's own pipes, with ``rank=None`` for its own notes); `Status`
(running, done, failed); rank 0's ``ctx.log`` values in `Metrics` batches (a few a second: the worker
gathers them, `dtrain_magic.worker.pulse`), `Total` for ``ctx.set_total`` and `DataProgress` for its
``ctx.data`` loaders; every rank's `Pulse` twice a second (its progress counters and CPU time: hang and stall
detection, per-rank step rates, throughput) and rank 0's `ModelFacts` once its model is prepared; then
`Result` (its cloudpickled return value) or `Error`. A second `Hello` from a rank means the backend restarted
the workers. The driver's message pump dispatches on the class.

The Spark launcher's rank watch speaks the same protocol on a listener of its own: each worker's watchdog
process sends `RankStarted`, then `RankDone` once the worker ended in Python; a connection that closes
without `RankDone` is a worker that died. (The watchdog runs without the package, ``python -S -I``: it
sends the wire tuples of these two classes itself, and a unit test checks they agree.)

A standby (`dtrain_magic.launchers.standby`: a launch started before the run that will use it) speaks it on a
listener of its own too: each waiting worker sends `StandbyReady` once it can run a job; the notebook answers
with one `StandbyJob` (the run's cloudpickled `WorkerJob` and what changed in the notebook since the launch) or
`StandbyRelease` (nothing to run: the worker returns, and the launch ends).

The notebook also writes to a rank's connection, once: `StopAt` (every rank stops after the same ``ctx.step``
count: a pruned sweep trial, `dtrain_magic.driver.step_stop`), read by the rank's pulse thread. The rank answers
`Stopped` when it stopped there, or `StopMissed` when it had already passed that step (the notebook then stops the
run as Stop does).

An interactive session (`dtrain_magic.session`) is a run whose function serves the notebook's cells: its messages
(the cells, values and pushes, interrupts) are declared in `dtrain_magic.session.protocol` and added to this
protocol with `extend_protocol`.

On the wire a message is a plain tuple, ``(KIND, *fields)`` in the order the fields are declared
(`Message.wire`), which pickles about twice as fast as the instance (``ctx.log`` every step goes through
this); `decode` turns it back into its class on the reading side. Sender and reader are always the same
version of this package.
"""

from __future__ import annotations

import queue
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from operator import attrgetter
from typing import Any, Callable, ClassVar

from .errors import log_dropped


class Message:
    """One channel message: a frozen dataclass with a ``KIND`` tag, sent as its `wire` tuple."""

    __slots__ = ()
    KIND: ClassVar[str]
    _values: ClassVar[Callable[["Message"], tuple]]  # the fields' values in declared order (set by `_protocol`)

    def wire(self) -> tuple:
        """``(KIND, *fields)``: what travels over the connection; `decode` reverses it."""
        return (self.KIND, *self._values(self))


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """A worker connected (sent first). A second one from the same rank: the backend restarted the workers.

    ``stack_file``: where the worker's Python stacks go when it gets `procfacts.STACK_SIGNAL` (empty: none);
    ``node``: the backend's id of its machine (Ray's node id; empty elsewhere): how to reach it from afar."""

    KIND: ClassVar[str] = "hello"
    rank: int
    pid: int
    host: str
    stack_file: str = ""
    node: str = ""


@dataclass(frozen=True, slots=True)
class Output(Message):
    """Text a worker wrote (``stream`` is ``"stdout"`` or ``"stderr"``); ``rank`` None: the launcher's own note."""

    KIND: ClassVar[str] = "out"
    rank: int | None
    stream: str
    text: str


@dataclass(frozen=True, slots=True)
class Metric(Message):
    """Rank 0's ``ctx.log``: ``metrics`` at ``step``, stamped with the worker's clock (ms since the epoch)."""

    KIND: ClassVar[str] = "metric"
    rank: int
    step: int
    metrics: dict[str, float]
    timestamp_ms: int


@dataclass(frozen=True, slots=True)
class Metrics(Message):
    """Rank 0's ``ctx.log`` values gathered in the worker: ``entries`` are ``(step, metrics, timestamp_ms)`` in
    the order they were logged; ``thinned`` values were left out (a loop logging faster than MLflow can take,
    `dtrain_magic.worker.pulse.Gate`)."""

    KIND: ClassVar[str] = "metrics"
    rank: int
    entries: tuple[tuple[int, dict[str, float], int], ...]
    thinned: int = 0


@dataclass(frozen=True, slots=True)
class Pulse(Message):
    """A rank's progress, twice a second, from a thread of its own: how many steps (``ctx.step``/``train_step``
    calls, else ``ctx.log`` calls), samples and tokens its training thread has gone through, how many of those
    counts were bumped at all (``calls``: any progress), its process's CPU seconds and when (unix time). A rank
    whose counters and CPU stand still is not progressing; one that sends nothing at all is blocked even for
    Python."""

    KIND: ClassVar[str] = "pulse"
    rank: int
    steps: int
    samples: int
    tokens: int
    calls: int
    cpu_s: float
    unix_time: float


@dataclass(frozen=True, slots=True)
class ModelFacts(Message):
    """Rank 0's model, once prepared, for model FLOP/s and MFU: its ``parameters``, the FLOPs per sample or per
    token when given or derived (0: unknown), the device's name and peak FLOP/s for the run's precision (0:
    none known) and a ``note`` saying why not."""

    KIND: ClassVar[str] = "model"
    rank: int
    parameters: int
    flops_per_sample: float
    flops_per_token: float
    device: str
    peak_flops: float
    note: str


@dataclass(frozen=True, slots=True)
class Status(Message):
    """A worker's state: ``"running"`` (the function was called), ``"done"`` or ``"failed"`` (with ``detail``)."""

    KIND: ClassVar[str] = "status"
    rank: int
    state: str
    detail: str


@dataclass(frozen=True, slots=True)
class Total(Message):
    """``ctx.set_total(steps)`` on rank 0: the run's length, for the progress bar and its ETA."""

    KIND: ClassVar[str] = "total"
    rank: int
    steps: int


@dataclass(frozen=True, slots=True)
class DataProgress(Message):
    """Rank 0's ``ctx.data(name)`` loader: ``batch`` of ``batches`` batches of ``epoch`` done (a few per second)."""

    KIND: ClassVar[str] = "data"
    rank: int
    name: str
    epoch: int
    batch: int
    batches: int


@dataclass(frozen=True, slots=True)
class Result(Message):
    """A rank's return value, cloudpickled in the worker (unpickled in the notebook once every rank's is in), and
    ``outputs``: what its ``ctx.write`` calls wrote, sealed (`dtrain_magic.data.outputs.OutputWriter.seal`; ``""``:
    nothing), which the driver commits once every rank's result of the last attempt is in."""

    KIND: ClassVar[str] = "result"
    rank: int
    pickled_value: bytes
    outputs: str = ""


@dataclass(frozen=True, slots=True)
class Error(Message):
    """A rank's failure: the exception's one-line ``summary``, its ``traceback`` (trimmed to the cell's
    frames) and when it happened (``unix_time``: the earliest error of a run is its cause). ``rank`` is None
    for a message the notebook could not read."""

    KIND: ClassVar[str] = "error"
    rank: int | None
    summary: str
    traceback: str
    unix_time: float


@dataclass(frozen=True, slots=True)
class RankStarted(Message):
    """Rank watch: the watchdog of ``rank``'s worker is connected (its connection now stands for the worker)."""

    KIND: ClassVar[str] = "start"
    rank: int


@dataclass(frozen=True, slots=True)
class RankDone(Message):
    """Rank watch: ``rank``'s worker ended in Python (result or reported error), so its closing is no death."""

    KIND: ClassVar[str] = "done"
    rank: int


@dataclass(frozen=True, slots=True)
class RankDied(Message):
    """Rank watch: ``rank``'s worker ended without `RankDone`; ``evidence`` is what its watchdog found on its host
    (a fatal signal Python reported, an out-of-memory kill in the kernel log or cgroup), empty when nothing."""

    KIND: ClassVar[str] = "died"
    rank: int
    evidence: str


@dataclass(frozen=True, slots=True)
class StackRequest(Message):
    """Rank watch, notebook → watchdog: dump the worker's Python stacks and answer with a `StackReply`."""

    KIND: ClassVar[str] = "stacks?"
    serial: int


@dataclass(frozen=True, slots=True)
class StackReply(Message):
    """Rank watch, watchdog → notebook: ``rank``'s stacks for request ``serial`` (``text``: the dump, empty when
    none came) and the process's ``state`` (``dumped``, ``stopped``, ``no answer``, ``gone``, ``no handler``)."""

    KIND: ClassVar[str] = "stacks"
    rank: int
    serial: int
    state: str
    text: str


@dataclass(frozen=True, slots=True)
class StandbyReady(Message):
    """A standby's worker is ready for a job (torch imported, process group joined): its rank, pid and host;
    ``done``: the token of the job this process just finished (a reused worker's, `StandbyJob.token`), else empty."""

    KIND: ClassVar[str] = "ready"
    rank: int
    pid: int
    host: str
    done: str = ""


@dataclass(frozen=True, slots=True)
class StandbyJob(Message):
    """The run a standby's workers take over: ``pickled_job`` (the cloudpickled `WorkerJob`, which names the
    run's channel), the notebook's working directory (``cwd``), the environment variables set (``env_set``) and
    removed (``env_unset``) in the notebook since the launch, for workers that inherited its environment, and
    the MLflow ``tracking_uri`` (per-node system metrics on a cluster); ``token``: this job's, set by the standby
    (a reused worker names it in its next `StandbyReady`)."""

    KIND: ClassVar[str] = "job"
    pickled_job: bytes
    cwd: str | None
    env_set: dict[str, str]
    env_unset: tuple[str, ...]
    tracking_uri: str | None
    token: str = ""


@dataclass(frozen=True, slots=True)
class StandbyRelease(Message):
    """No run for this standby (idle timeout, ``%distribute_release``, another placement, the kernel exits):
    the worker returns without running anything; ``reason`` says why."""

    KIND: ClassVar[str] = "release"
    reason: str


@dataclass(frozen=True, slots=True)
class StopAt(Message):
    """Notebook → every rank of a run: stop right after ``ctx.step`` count ``step`` (the same on every rank, beyond
    where any rank is: `dtrain_magic.driver.step_stop`); ``reason`` says why (a pruned sweep trial)."""

    KIND: ClassVar[str] = "stop at"
    step: int
    reason: str


@dataclass(frozen=True, slots=True)
class Stopped(Message):
    """A rank stopped after ``ctx.step`` count ``step``, as `StopAt` asked: it ends cleanly, with no result."""

    KIND: ClassVar[str] = "stopped"
    rank: int
    step: int


@dataclass(frozen=True, slots=True)
class StopMissed(Message):
    """A rank was at ``ctx.step`` count ``steps``, past the ``stop_at`` it was asked to stop after: the ranks cannot
    all stop at that step (the notebook stops the run as Stop does)."""

    KIND: ClassVar[str] = "stop missed"
    rank: int
    steps: int
    stop_at: int


def _protocol(*classes: type[Message]) -> dict[str, type[Message]]:
    """Give each class its fields' getter (``operator.attrgetter``, in C: `wire` is on every ``ctx.log``) and
    index the classes by kind for `decode`."""
    kinds: dict[str, type[Message]] = {}
    for cls in classes:
        names = cls.__match_args__
        get = attrgetter(*names)
        cls._values = staticmethod(get if len(names) > 1 else lambda message, get=get: (get(message),))
        assert cls.KIND not in kinds, cls.KIND
        kinds[cls.KIND] = cls
    return kinds


_BY_KIND = _protocol(Hello, Output, Metric, Metrics, Pulse, ModelFacts, Status, Total, Result, Error, RankStarted,
                     RankDone, RankDied, StackRequest, StackReply, StandbyReady, StandbyJob, StandbyRelease,
                     DataProgress, StopAt, Stopped, StopMissed)


class ProtocolError(ValueError):
    """What arrived is not the wire form of any `Message`."""


def decode(wire: Any) -> Message:
    """The `Message` whose `Message.wire` is ``wire``; `ProtocolError` if there is none."""
    try:
        return _BY_KIND[wire[0]](*wire[1:])
    except (KeyError, IndexError, TypeError):
        raise ProtocolError(f"not a channel message: {wire!r:.100}") from None


def extend_protocol(*classes: type[Message]) -> None:
    """Add a feature's own message classes to the protocol (an interactive session's, `dtrain_magic.session.protocol`,
    declares them there and calls this once, when imported): `decode` reads them from then on. A kind may be
    declared once only."""
    for kind, cls in _protocol(*classes).items():
        if _BY_KIND.get(kind, cls) is not cls:
            raise ValueError(f"channel message kind {kind!r} is taken by {_BY_KIND[kind].__name__}")
        _BY_KIND[kind] = cls


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
    served by ``serve(conn, serial)`` in a thread of its own (serials count from 1, in accept order), which closes
    it when ``serve`` returns: ``serve`` never closes it itself."""

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
                server = threading.Thread(target=self._serve_then_close, args=(conn, serial), name=self._name,
                                          daemon=True)
                self._servers.append(server)
            server.start()

    def _serve_then_close(self, conn: Connection, serial: int) -> None:
        try:
            self._serve(conn, serial)
        finally:
            # Closed here only, under the lock `close` hangs connections up under: two threads closing one
            # connection raced (EBADF, or worse a descriptor number reused meanwhile closed or shut down).
            with self._lock:
                try:
                    conn.close()
                except OSError as exc:
                    log_dropped(__name__, "close", exc)

    def send(self, conn: Connection, wire: tuple) -> bool:
        """Write ``wire`` to one accepted connection (its server thread keeps reading it); False when it is closed
        or its peer is gone. Under the lock connections are closed under, so a closed descriptor's number, reused
        meanwhile, is never written to."""
        with self._lock:
            if conn.closed:
                return False
            try:
                conn.send(wire)
            except (OSError, EOFError, ValueError):
                return False
            return True

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
        except OSError as exc:
            log_dropped(__name__, "close", exc)
        with self._lock:
            for conn in self._connections:  # each server's recv returns (EOF), and its thread closes it
                _hang_up(conn)


def _hang_up(conn: Connection) -> None:
    """Make the peer see ``conn`` close although its server thread is blocked reading it: ``close()`` alone
    frees the descriptor but (on Linux) leaves the socket open while a ``recv`` is in progress on it, so
    nothing reaches the peer (a rank watch's watchdog would never kill its worker). ``shutdown`` does."""
    try:
        with socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:  # a dup: closing it is safe
            sock.shutdown(socket.SHUT_RDWR)
    except (OSError, ValueError):  # already closed
        pass


class Channel:
    """Driver side: accepts worker connections and funnels their messages into one queue."""

    def __init__(self, host: str = "127.0.0.1"):
        # (connection serial or None for the driver's own messages, message)
        self.messages: "queue.Queue[tuple[int | None, Message]]" = queue.Queue()
        self._delivered: set[int] = set()  # connections get() has returned a message from
        self._retired: set[int] = set()
        self.last_serial: int | None = None
        self._ranks: dict[int, tuple[int, Connection]] = {}  # rank → (serial, connection) of its latest Hello
        self._listener = AuthenticatedListener(host, self._read_loop, "dtrain-channel-read")
        self.address = ChannelAddress(host, self._listener.port, self._listener.authkey)

    def _read_loop(self, conn: Connection, serial: int) -> None:
        try:
            while True:
                message = decode(conn.recv())
                if type(message) is Hello:  # the rank's connection, for `send_to_ranks` (a restart's replaces it)
                    self._ranks[message.rank] = (serial, conn)
                self.messages.put((serial, message))
        except (EOFError, OSError):
            pass
        except Exception as exc:  # unpicklable, or not a message: report rather than lose it silently
            self.messages.put((serial, Error(None, f"unreadable message from a worker: {exc!r}", "", time.time())))

    def put(self, message: Message) -> None:
        """Inject a message from the driver side (a launcher's captured process output, say)."""
        self.messages.put((None, message))

    def get(self, timeout: float) -> Message | None:
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

    def send_to_ranks(self, message: Message, world_size: int) -> bool:
        """Write ``message`` to each of ranks 0 .. ``world_size - 1`` over its own connection (`StopAt`); False,
        sending nothing, while a rank has not said `Hello` yet, or when a connection is gone."""
        targets = [self._ranks.get(rank) for rank in range(world_size)]
        if any(target is None or target[0] in self._retired for target in targets):
            return False
        wire = message.wire()
        return all([self._listener.send(conn, wire) for _, conn in targets])  # a list: every rank is written to

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

    def send(self, message: Message) -> None:
        if self._broken:
            return
        wire = message.wire()
        with self._lock:
            try:
                self._conn.send(wire)
            except (OSError, EOFError):
                # The notebook went away (run cancelled): keep training code from crashing on a log call.
                self._broken = True

    def fileno(self) -> int:
        """The connection's descriptor: readable once the notebook wrote to this rank (for
        `multiprocessing.connection.wait`)."""
        return self._conn.fileno()

    def receive(self) -> Message | None:
        """The message the notebook wrote to this rank (`StopAt`), None when nothing is waiting; `EOFError` or
        `OSError` once the notebook is gone. One reader: the rank's pulse thread."""
        if not self._conn.poll(0):
            return None
        return decode(self._conn.recv())

    def close(self) -> None:
        with self._lock:
            try:
                self._conn.close()
            except OSError as exc:
                log_dropped(__name__, "close", exc)
