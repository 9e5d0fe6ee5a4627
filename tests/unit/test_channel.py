"""The notebook↔worker channel: authenticated, loopback-only by default."""

import time
from multiprocessing.connection import AuthenticationError, Client

import pytest

from dtrain_magic.channel import Channel, ChannelAddress, WorkerLink


def test_messages_arrive_and_secret_is_not_in_repr():
    with Channel() as channel:
        assert channel.address.host == "127.0.0.1"
        assert channel.address.authkey.hex() not in repr(channel.address)
        link = WorkerLink(channel.address, rank=0)
        link.send(("out", 0, "stdout", "hi\n"))
        link.close()
        assert channel.get(timeout=5) == ("out", 0, "stdout", "hi\n")


def test_a_client_without_the_secret_is_refused():
    with Channel() as channel:
        with pytest.raises(AuthenticationError):
            Client((channel.address.host, channel.address.port), authkey=b"wrong")
        # the channel still serves the right client afterwards
        link = WorkerLink(channel.address, rank=1)
        link.send(("status", 1, "running", ""))
        assert channel.get(timeout=5) == ("status", 1, "running", "")
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
        link.send(("metric", 0, 0, {"loss": 1.0}, 0))
