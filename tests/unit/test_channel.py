"""The notebook↔worker channel: authenticated, loopback-only by default; typed messages with a tuple wire form."""

import ast
import sys
import time
from multiprocessing.connection import AuthenticationError, Client

import pytest

from dtrain_magic import channel as ch
from dtrain_magic.channel import Channel, ChannelAddress, WorkerLink
from dtrain_magic.launchers import watchdog


def test_messages_arrive_and_secret_is_not_in_repr():
    with Channel() as channel:
        assert channel.address.host == "127.0.0.1"
        assert channel.address.authkey.hex() not in repr(channel.address)
        link = WorkerLink(channel.address, rank=0)
        link.send(ch.Output(0, "stdout", "hi\n"))
        link.close()
        assert channel.get(timeout=5) == ch.Output(0, "stdout", "hi\n")


def test_a_client_without_the_secret_is_refused():
    with Channel() as channel:
        with pytest.raises(AuthenticationError):
            Client((channel.address.host, channel.address.port), authkey=b"wrong")
        # the channel still serves the right client afterwards
        link = WorkerLink(channel.address, rank=1)
        link.send(ch.Status(1, "running", ""))
        assert channel.get(timeout=5) == ch.Status(1, "running", "")
        link.close()


def test_close_returns_quickly_and_frees_the_port():
    channel = Channel()
    port = channel.address.port
    started = time.monotonic()
    channel.close()
    assert time.monotonic() - started < 2
    import socket

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))


def test_send_after_notebook_went_away_does_not_raise():
    channel = Channel()
    link = WorkerLink(ChannelAddress(channel.address.host, channel.address.port, channel.address.authkey), rank=0)
    channel.close()
    time.sleep(0.1)
    for _ in range(3):
        link.send(ch.Metric(0, 0, {"loss": 1.0}, 0))


# One of each kind, with the types a worker sends (rank None: a launcher's own note, an unreadable message).
EVERY_KIND = [
    ch.Hello(0, 4242, "node-a"),
    ch.Output(1, "stderr", "warning: x\n"),
    ch.Output(None, "stderr", "dtrain_magic: restarting\n"),
    ch.Metric(0, 7, {"loss": 0.25, "lr": 1e-3}, 1_700_000_000_123),
    ch.Status(1, "failed", "ValueError: bad"),
    ch.Total(0, 100),
    ch.Result(1, b"\x80\x05K\x01."),
    ch.Error(0, "ValueError: bad", "Cell In[3], line 2, in train\n", 1_700_000_000.5),
    ch.RankStarted(1),
    ch.RankDone(1),
    ch.Hello(1, 4243, "node-a", "/tmp/dtrain_magic-stacks-0/4243.txt", "node-id"),
    ch.Metrics(0, ((7, {"loss": 0.25}, 1_700_000_000_123),), 2),
    ch.Pulse(1, 10, 320, 0, 42, 1.25, 1_700_000_000.5),
    ch.ModelFacts(0, 1000, 0.0, 6000.0, "cpu", 0.0, "no MFU on CPU"),
    ch.RankDied(1, "killed by SIGSEGV"),
    ch.StackRequest(3),
    ch.StackReply(1, 3, "stopped", ""),
    ch.StandbyReady(1, 4242, "node-a"),
    ch.StandbyJob(b"\x80\x05K\x01.", "/home/user/notebooks", {"MY_FLAG": "1"}, ("OLD_FLAG",), "sqlite:///x.db"),
    ch.StandbyRelease("idle for 600 s"),
    ch.DataProgress(0, "train", 2, 120, 500),
    ch.StopAt(12, "pruned by Optuna at val_loss step 9"),
    ch.Stopped(1, 12),
    ch.StopMissed(1, 14, 12),
]


def test_every_kind_crosses_a_real_channel_as_itself():
    with Channel() as channel:
        link = WorkerLink(channel.address, rank=0)
        for message in EVERY_KIND:
            link.send(message)
        link.close()
        received = [channel.get(timeout=5) for _ in EVERY_KIND]
    assert received == EVERY_KIND
    assert [type(m) for m in received] == [type(m) for m in EVERY_KIND]


def test_the_wire_form_is_a_plain_tuple_of_kind_and_fields_in_declared_order():
    metric = ch.Metric(0, 7, {"loss": 0.25}, 123)
    assert metric.wire() == ("metric", 0, 7, {"loss": 0.25}, 123)
    assert ch.RankDone(3).wire() == ("done", 3)
    for message in EVERY_KIND:
        assert type(message.wire()) is tuple and ch.decode(message.wire()) == message


def test_messages_are_frozen():
    with pytest.raises(AttributeError):
        ch.Metric(0, 1, {}, 0).step = 2


def test_every_message_class_has_a_kind_of_its_own_and_is_decodable():
    # (dataclass(slots=True) leaves the class it replaced among the subclasses: keep the module's own)
    classes = {cls for cls in ch.Message.__subclasses__() if getattr(ch, cls.__name__, None) is cls}
    assert {type(m) for m in EVERY_KIND} == set(classes)
    assert len({cls.KIND for cls in classes}) == len(classes)


@pytest.mark.parametrize("wire", [("no-such-kind", 0), ("metric", 0, 1), (), "out", None])
def test_what_is_not_a_message_is_a_protocol_error(wire):
    with pytest.raises(ch.ProtocolError, match="not a channel message"):
        ch.decode(wire)


def test_a_connection_that_sends_something_else_becomes_an_error_message():
    with Channel() as channel:
        conn = Client((channel.address.host, channel.address.port), authkey=channel.address.authkey)
        conn.send(("metric", 0))  # wrong arity: not what any worker sends
        message = channel.get(timeout=5)
        conn.close()
    assert isinstance(message, ch.Error) and message.rank is None
    assert "unreadable message from a worker" in message.summary and "not a channel message" in message.summary


def test_the_watchdog_sends_the_rank_watch_messages_wire_form():
    """The watchdog runs as ``python -S -I`` without the package: its tuples must be the classes' wire form."""
    assert watchdog.rank_started(3) == ch.RankStarted(3).wire()
    assert watchdog.rank_done(3) == ch.RankDone(3).wire()
    assert ch.decode(watchdog.rank_started(3)) == ch.RankStarted(3)
    assert ch.decode(watchdog.rank_done(3)) == ch.RankDone(3)


def test_the_watchdog_imports_the_standard_library_only():
    tree = ast.parse(open(watchdog.__file__).read())
    imported = {alias.name.split(".")[0]
                for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0]
                 for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0}
    assert not any(isinstance(node, ast.ImportFrom) and node.level > 0 for node in ast.walk(tree))
    assert imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)


def test_closing_the_listener_hangs_up_on_connected_peers():
    """The peer sees the close although the channel's reader thread is blocked reading its connection (the
    rank watch relies on it: a watchdog kills its worker when the notebook's side closes)."""
    channel = Channel()
    conn = Client((channel.address.host, channel.address.port), authkey=channel.address.authkey)
    conn.send(ch.Hello(0, 1, "h").wire())
    assert channel.get(timeout=5) == ch.Hello(0, 1, "h")  # its reader thread is now blocked in recv()
    channel.close()
    assert conn.poll(5)
    with pytest.raises(EOFError):
        conn.recv()
    conn.close()
