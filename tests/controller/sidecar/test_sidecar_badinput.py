"""Bad input against a real sidecar: every malformed, oversized, unknown, out-of-order or
unauthenticated message is refused with a clear error (or, past the hard limit, dropped),
the sidecar stays up, and its state is exactly what it was before."""

from __future__ import annotations

import shutil

import msgpack
import numpy as np
import pytest
import torch
import zmq

from hicache import CacheConfig, DevicePools
from hicache.controller.client.device_share import export_pools
from hicache.controller.client.sidecar_client import SidecarController
from hicache.controller.wire.fields import encode_refs
from hicache.controller.wire.protocol import pack
from hicache.controller_api import PageRef
from hicache.keys import namespace_hash, page_hashes
from hicache.types import ComponentType
from tests.support.cache import make_layout
from tests.support.sidecar import Sidecar, short_tmpdir, token_tcp_args, wait_for

MIX = "full+swa+mamba"
PAGE = 4
LIMIT = 65536
TOKEN = "t0k3n-for-the-tcp-test-0123456789"


class Raw:
    """A bare DEALER: whatever bytes a test wants, and the replies as they come."""

    def __init__(self, endpoint: str, **options) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        for k, v in options.items():
            setattr(self.sock, k, v)
        self.sock.connect(endpoint)

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout_s: float = 10.0) -> dict | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return msgpack.unpackb(self.sock.recv(), raw=False)

    def request(self, verb: str, args: dict, req_id: int = 1, **env) -> dict:
        msg = {"v": 1, "id": req_id, "verb": verb, "ttl_ms": 10_000, "args": args, **env}
        self.send(pack(msg))
        reply = self.recv()
        assert reply is not None, f"no reply to {verb}"
        return reply

    def hello(self, engine_id: str = "raw", layout=None, page_size: int = PAGE) -> dict:
        layout = layout or make_layout(MIX)
        return self.request(
            "hello",
            {
                "role": "engine",
                "engine_id": engine_id,
                "pid": 1,
                "fingerprint": layout.fingerprint(page_size),
                "layout": layout.to_dict(),
                "page_size": page_size,
            },
        )

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture(scope="module")
def sidecar():
    work = short_tmpdir()
    args = [*token_tcp_args(work, TOKEN, MIX, PAGE), "--set", f"max_message_bytes={LIMIT}"]
    sc = Sidecar(work, args=args)
    sc.start()
    # Some state to keep unchanged: an engine with a backed-up prefix and a pin.
    layout = make_layout(MIX)
    cfg = CacheConfig(
        page_size=PAGE, sliding_window=8, full_slots=256, mamba_slots=8, shared_memory=True
    )
    pools = DevicePools.allocate(layout, cfg)
    engine = SidecarController(sc.endpoint, "engine-under-test", start_heartbeats=True)
    engine.register(layout, PAGE, pools)
    fp = layout.fingerprint(PAGE)
    hashes = page_hashes(np.arange(24), fp, PAGE)
    parents = [namespace_hash(fp, None), *hashes[:-1]]
    pages = pools.alloc_kv_pages(len(hashes))
    refs = [PageRef(ComponentType.FULL, h, p, int(d)) for h, p, d in zip(hashes, parents, pages)]
    assert engine.backup(refs).wait(30)
    assert engine.pin([r.key for r in refs[:2]], 600) is not None
    admin = sc.admin()
    wait_for(lambda: admin.call(_verb("stats"))["disk"]["pending_writes"] == 0, 30, "writes")
    yield sc, admin, engine, refs
    admin.close()
    engine.close()
    pools.close()
    sc.stop()
    shutil.rmtree(work, ignore_errors=True)


def _verb(name: str):
    from hicache.controller.wire.protocol import Verb

    return Verb(name)


def _state(admin) -> dict:
    """What the sidecar holds: every controller counter and residency, and who is
    registered (the sidecar's own request counters aside, and the miss reasons: an engine
    refused for its layout counts why its lookups will miss)."""
    stats = admin.call(_verb("stats"))
    stats.pop("sidecar")
    stats.pop("miss_reasons", None)
    engines = admin.call(_verb("engines"))["engines"]
    stats["engines_list"] = sorted(
        (e["engine_id"], e["role"], e["registered"]) for e in engines if e["role"] == "engine"
    )
    return stats


def _req(verb: str, args: dict, **env) -> list[bytes]:
    return [pack({"v": 1, "id": 5, "ttl_ms": 1000, "verb": verb, "args": args, **env})]


# Each case: what to send, the error code expected, and whether to handshake first.
def _cases(refs):
    valid = _req("heartbeat", {})[0]
    other = make_layout("full")
    layout = make_layout(MIX)
    hello = {
        "role": "engine",
        "engine_id": "x",
        "pid": 1,
        "fingerprint": layout.fingerprint(PAGE),
        "layout": layout.to_dict(),
        "page_size": PAGE,
    }
    other_hello = {**hello, "fingerprint": other.fingerprint(PAGE), "layout": other.to_dict()}
    missing_segment = {
        "page_size": PAGE,
        "device": "cpu",
        "buffers": {
            "full": {
                "kind": "shm",
                "shm_name": "no-such-segment",
                "dtype": "float32",
                "shape": [2, 2, 8, 2, 4],
                "key": bytes(16),
            }
        },
    }
    one_key = {"c": b"\x00", "h": b"x" * 16}
    return {
        "garbage": ([b"\x00\xff\x13garbage bytes"], "bad_message", False),
        "truncated msgpack": ([valid[: len(valid) // 2]], "bad_message", False),
        "not a map": ([pack([1, 2, 3])], "bad_message", False),
        "extension type": ([msgpack.packb(msgpack.ExtType(5, b"x"))], "bad_message", False),
        "string id": (_req("heartbeat", {}, id="5"), "bad_message", False),
        "missing ttl": (
            [pack({"v": 1, "id": 5, "verb": "heartbeat", "args": {}})],
            "bad_message",
            False,
        ),
        "two frames": ([valid, valid], "bad_message", False),
        "unknown verb": (_req("rm -rf", {}), "unknown_verb", False),
        "old protocol": (_req("heartbeat", {}, v=0), "version_mismatch", False),
        "oversized": ([b"\x00" * (LIMIT + 1)], "too_large", False),
        "verb before hello": (_req("lookup", {}), "no_session", False),
        "hello, wrong type": (_req("hello", {**hello, "page_size": "4"}), "bad_args", False),
        "hello, unknown arg": (_req("hello", {**hello, "x": 1}), "bad_args", False),
        "hello, forged fingerprint": (
            _req("hello", {**hello, "fingerprint": b"\x01" * 16}),
            "bad_args",
            False,
        ),
        "hello, another layout": (_req("hello", other_hello), "layout_mismatch", False),
        "admin, wrong token": (
            _req("hello", {"role": "admin", "engine_id": "a", "token": b"nope"}),
            "forbidden",
            False,
        ),
        # On a handshaken engine connection:
        "second hello": (_req("hello", hello), "out_of_order", True),
        "backup before register": (
            _req("backup", {"refs": encode_refs(refs[:1])}),
            "out_of_order",
            True,
        ),
        "admin verb from engine": (
            _req("clear", {"tiers": ["host"], "all_namespaces": True}),
            "forbidden",
            True,
        ),
        "lookup, wrong type": (_req("lookup", {"hashes": 12, "components": [0]}), "bad_args", True),
        "lookup, ragged hashes": (
            _req("lookup", {"hashes": b"x" * 17, "components": [0]}),
            "bad_args",
            True,
        ),
        "lookup, unknown component": (
            _req("lookup", {"hashes": b"x" * 16, "components": [9]}),
            "bad_args",
            True,
        ),
        "pin, negative ttl": (_req("pin", {"keys": one_key, "ttl_s": -1.0}), "bad_args", True),
        "register, missing segment": (
            _req("register", missing_segment),
            "registration_refused",
            True,
        ),
        "register, bad device": (
            _req("register", {"page_size": PAGE, "device": "tpu", "buffers": {}}),
            "bad_args",
            True,
        ),
    }


CASE_NAMES = list(_cases([PageRef(ComponentType.FULL, b"h" * 16, b"p" * 16, 0)]))


@pytest.mark.parametrize("case", CASE_NAMES)
def test_bad_message_gets_an_error_and_changes_nothing(sidecar, case):
    sc, admin, _engine, refs = sidecar
    frames, code, handshake = _cases(refs)[case]
    before = _state(admin)
    raw = Raw(sc.endpoint)
    try:
        if handshake:
            assert raw.hello(engine_id=f"raw-{len(case)}")["ok"]
        raw.send(*frames)
        reply = raw.recv()
        assert reply is not None, f"{case}: no reply"
        assert reply["ok"] is False and reply["error"]["code"] == code, reply
        assert len(reply["error"]["message"]) > 10  # says what was wrong
        if handshake:
            raw.request("bye", {}, req_id=99)
    finally:
        raw.close()
    assert admin.call(_verb("health"))["status"] == "ok"
    assert _state(admin) == before


def test_frame_past_the_hard_limit_is_dropped_and_the_sidecar_serves_on(sidecar):
    sc, admin, _engine, _refs = sidecar
    before = _state(admin)
    raw = Raw(sc.endpoint)
    raw.send(b"\x00" * (4 * LIMIT + 1))
    assert raw.recv(timeout_s=1.0) is None  # ZeroMQ dropped it with the connection
    raw.close()
    assert admin.call(_verb("health"))["status"] == "ok"
    assert _state(admin) == before


def test_a_flood_of_requests_is_answered_one_by_one(sidecar):
    sc, admin, _engine, _refs = sidecar
    raw = Raw(sc.endpoint)
    assert raw.hello(engine_id="flood")["ok"]
    lookup = {"hashes": b"\x07" * 16 * 8, "components": [0, 1, 2]}
    n = 2000
    for i in range(n):
        if i % 4 == 3:
            raw.send(b"\xc1 not msgpack")
        else:
            raw.send(pack({"v": 1, "id": i, "verb": "lookup", "ttl_ms": 60_000, "args": lookup}))
    replies = [raw.recv(timeout_s=60) for _ in range(n)]
    assert all(r is not None for r in replies)
    ok = [r for r in replies if r["ok"]]
    assert len(ok) == n - n // 4
    assert all(r["result"]["presence"] == [b"\x00" * 8] * 3 for r in ok)
    assert sum(r["error"]["code"] == "bad_message" for r in replies if not r["ok"]) == n // 4
    raw.request("bye", {}, req_id=n + 1)
    raw.close()
    assert admin.call(_verb("health"))["status"] == "ok"


def _tcp(sc) -> str:
    return next(e for e in sc.info["endpoints"] if e.startswith("tcp://"))


def test_tcp_without_credentials_gets_nothing(sidecar):
    sc, admin, _engine, _refs = sidecar
    before = _state(admin)
    for options in ({}, {"plain_username": b"hicache", "plain_password": b"wrong-token-xxxxx"}):
        raw = Raw(_tcp(sc), **options)
        raw.send(pack({"v": 1, "id": 1, "verb": "health", "ttl_ms": 1000, "args": {}}))
        assert raw.recv(timeout_s=1.0) is None, f"answered without valid credentials: {options}"
        raw.close()
    assert _state(admin) == before


def test_tcp_with_the_token_is_served(sidecar):
    sc, _admin, _engine, _refs = sidecar
    raw = Raw(_tcp(sc), plain_username=b"hicache", plain_password=TOKEN.encode())
    reply = raw.hello(engine_id="tcp-engine")
    assert reply["ok"], reply
    assert raw.request("heartbeat", {}, req_id=2)["ok"]
    raw.request("bye", {}, req_id=3)
    raw.close()


def test_tcp_client_cannot_have_local_shared_memory_mapped(sidecar):
    """An authenticated TCP peer names the shared-memory pools of an engine on the
    sidecar's machine (their names and shapes are easy to learn) without the keys inside
    them: refused, whatever key it guesses (a TCP peer never names local memory), and the
    memory is untouched. A plain segment of another program, posing as a pool, likewise."""
    from multiprocessing import shared_memory

    sc, admin, _engine, _refs = sidecar
    before = _state(admin)
    cfg = CacheConfig(
        page_size=PAGE, sliding_window=8, full_slots=64, mamba_slots=4, shared_memory=True
    )
    victim = DevicePools.allocate(make_layout(MIX), cfg)
    buffers = export_pools(victim)["buffers"]
    other = shared_memory.SharedMemory(create=True, size=1 << 20)
    raw = Raw(_tcp(sc), plain_username=b"hicache", plain_password=TOKEN.encode())
    try:
        victim.full.buffer.normal_()
        content = victim.full.buffer.clone()
        other.buf[:] = np.random.default_rng(1).bytes(other.size)
        other_content = bytes(other.buf)
        assert raw.hello(engine_id="tcp-intruder")["ok"]
        for guess in (bytes(16), b"\xff" * 16, other_content[:16]):
            for d in buffers.values():
                d["key"] = guess
            for full_name in (buffers["full"]["shm_name"], other.name):
                buffers["full"]["shm_name"] = full_name
                args = {"page_size": PAGE, "device": "cpu", "buffers": buffers}
                reply = raw.request("register", args)
                assert reply["ok"] is False, reply
                assert reply["error"]["code"] == "registration_refused", reply
                assert "Unix socket" in reply["error"]["message"], reply
        raw.request("bye", {}, req_id=9)
        assert torch.equal(victim.full.buffer, content)
        assert bytes(other.buf) == other_content
    finally:
        raw.close()
        other.close()
        other.unlink()
        victim.close()
    assert _state(admin) == before


def test_unix_socket_is_private(sidecar):
    sc, *_ = sidecar
    assert (sc.socket.stat().st_mode & 0o777) == 0o600
    assert (sc.socket.parent.stat().st_mode & 0o077) == 0
    token = sc.socket.parent / "admin.token"
    assert (token.stat().st_mode & 0o777) == 0o600
