"""Threads sharing one sidecar connection (``controller/client/channel.py``): a thread
waiting for a reply must not keep another thread's request from going out. A waiter once
held the socket's lock through its poll, so every other thread's request waited until some
reply came: a lookup behind a backup's wait took the whole backup."""

from __future__ import annotations

import threading

import pytest
import zmq

import hicache.controller.client.channel as channel_mod
from hicache.controller.client.channel import Channel, SidecarClientConfig
from hicache.controller.wire.protocol import Verb, decode_request, ok_reply
from hicache.controller.wire.verbs import KeysArgs
from hicache.controller_api import PageKey
from hicache.types import ComponentType
from tests.support.sidecar import short_tmpdir, wait_for

ARGS = KeysArgs([PageKey(ComponentType.FULL, b"\1" * 16)])


@pytest.fixture
def router():
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)  # a sidecar that answers only when the test says so
    path = short_tmpdir("hcch") / "s.sock"
    sock.bind("ipc://" + str(path))
    yield sock, "ipc://" + str(path)
    sock.close(linger=0)


def _received(sock: zmq.Socket) -> tuple[bytes, int]:
    assert sock.poll(10_000), "no request reached the sidecar"
    ident, data = sock.recv_multipart()
    return ident, decode_request(data, 1 << 20).id


def test_a_request_goes_out_while_another_thread_waits_for_its_reply(router, monkeypatch):
    # A waiter sleeps up to a long slice at a time: with the socket's lock held through it,
    # the second request could not go out before the slice ended.
    monkeypatch.setattr(channel_mod, "POLL_SLICE_S", 20.0)
    sock, endpoint = router
    ch = Channel(endpoint, SidecarClientConfig())
    try:
        slow = ch.send(Verb.PREFETCH, ARGS, 120.0, connect_wait_s=10.0)
        ident, got = _received(sock)
        assert got == slow
        results = []
        waiter = threading.Thread(target=lambda: results.append(ch.wait(slow, 120.0)), daemon=True)
        waiter.start()
        wait_for(lambda: getattr(ch, "_reading", True), 10, "the waiter to sleep on the socket")
        sent = []
        sender = threading.Thread(
            target=lambda: sent.append(ch.send(Verb.PREFETCH, ARGS, 120.0)), daemon=True
        )
        sender.start()
        sender.join(5)
        assert not sender.is_alive(), "the request waited for the other thread's reply"
        assert _received(sock) == (ident, sent[0])  # it went out while the waiter waits
        assert waiter.is_alive()
        # Both answered: each thread gets its own reply, the waiter woken by it at once.
        sock.send_multipart([ident, ok_reply(sent[0], {"ok": False})])
        assert not ch.wait(sent[0], 10.0).ok
        sock.send_multipart([ident, ok_reply(slow, {"ok": True})])
        waiter.join(10)
        assert not waiter.is_alive() and results[0].ok
    finally:
        ch.close()
