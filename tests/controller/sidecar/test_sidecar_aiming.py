"""Registration cannot be aimed at memory that is not the registering engine's, and a
malformed handshake is a clear refusal (issue 17's probe).

* The "shorter shape" attack: a victim's segment named with fewer slots than it holds
  puts "the key" inside the victim's KV, zero until written, so a zero key used to pass.
  Now a segment must be exactly the tensor plus its key, the key is never all zero, a
  TCP peer may not name local memory at all, and a Unix-socket peer only segments of its
  own uid (SO_PEERCRED).
* ``hello`` with a layout field of the wrong type is ``bad_args`` naming the field, with
  no traceback in the log; a version of ``1.0`` or ``true`` is not version 1; a
  registration naming one segment twice is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
import torch

from hicache import CacheConfig, DevicePools
from hicache.controller.client.device_share import export_pools
from hicache.controller.sidecar.device_map import RegistrationRefused, map_pools
from hicache.controller.wire.protocol import Verb, pack
from hicache.controller.wire.security import PeerCredentials
from tests.controller.sidecar.test_sidecar_badinput import Raw
from tests.support.cache import make_layout
from tests.support.sidecar import Sidecar, short_tmpdir, token_tcp_args

MIX = "full+swa+mamba"
PAGE = 4
TOKEN = "t0k3n-for-the-aiming-test-0123456789"
NOBODY = 65534


def _victim() -> DevicePools:
    cfg = CacheConfig(
        page_size=PAGE, sliding_window=8, full_slots=64, mamba_slots=4, shared_memory=True
    )
    pools = DevicePools.allocate(make_layout(MIX), cfg)
    pools.full.buffer.normal_()
    return pools


def _shorter(desc: dict) -> dict:
    """The victim's description with half its slots and zero keys: "the key" then lies
    inside the victim's pool, in slots nobody has written yet."""
    for d in desc["buffers"].values():
        d["key"] = bytes(16)
    full = desc["buffers"]["full"]
    full["shape"][2] //= 2
    return desc


@pytest.fixture(scope="module")
def sidecar():
    work = short_tmpdir()
    sc = Sidecar(work, args=token_tcp_args(work, TOKEN, MIX, PAGE))
    sc.start()
    yield sc
    sc.stop()
    shutil.rmtree(work, ignore_errors=True)


def test_the_shorter_shape_with_a_zero_key_is_refused_in_process():
    victim = _victim()
    try:
        before = victim.full.buffer.clone()
        with pytest.raises(RegistrationRefused, match="all-zero key"):
            map_pools(victim.layout, PAGE, _shorter(export_pools(victim)))
        desc = export_pools(victim)
        desc["buffers"]["full"]["shape"][2] //= 2  # the real key, the shorter shape
        with pytest.raises(RegistrationRefused, match=r"not the .* of its shape"):
            map_pools(victim.layout, PAGE, desc)
        stranger = PeerCredentials(NOBODY, NOBODY, 1)
        with pytest.raises(RegistrationRefused, match="belongs to uid"):
            map_pools(victim.layout, PAGE, export_pools(victim), peer=stranger)
        with pytest.raises(RegistrationRefused, match="Unix socket"):
            map_pools(victim.layout, PAGE, export_pools(victim), peer=None)
        assert torch.equal(victim.full.buffer, before)
        mapped = map_pools(victim.layout, PAGE, export_pools(victim))  # its own: mapped
        mapped.buffers = None
        assert mapped.close()
    finally:
        victim.close()


def test_the_shorter_shape_attack_over_tcp_is_refused(sidecar):
    victim = _victim()
    raw = Raw(
        next(e for e in sidecar.info["endpoints"] if e.startswith("tcp://")),
        plain_username=b"hicache",
        plain_password=TOKEN.encode(),
    )
    try:
        before = victim.full.buffer.clone()
        assert raw.hello(engine_id="tcp-aimer")["ok"]
        for desc in (_shorter(export_pools(victim)), export_pools(victim)):
            reply = raw.request("register", {"page_size": PAGE, **desc}, req_id=2)
            assert reply["ok"] is False, reply
            assert reply["error"]["code"] == "registration_refused", reply
        assert torch.equal(victim.full.buffer, before)
        admin = sidecar.admin()
        assert not any(r["registered"] for r in admin.call(Verb.ENGINES)["engines"])
        admin.close()
    finally:
        raw.close()
        victim.close()


_ATTACKER = r"""
import json, os, sys
import msgpack, zmq
os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[2]))
plan = json.loads(sys.stdin.read())
sock = zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(sys.argv[1])
def call(i, verb, args):
    sock.send(msgpack.packb({"v": 1, "id": i, "verb": verb, "ttl_ms": 10000, "args": args}))
    if not sock.poll(10000):
        return None
    return msgpack.unpackb(sock.recv(), raw=False)
def unhex(v):
    if isinstance(v, dict):
        return {k: unhex(x) for k, x in v.items()}
    if isinstance(v, list):
        return [unhex(x) for x in v]
    if isinstance(v, str) and v.startswith("hex:"):
        return bytes.fromhex(v[4:])
    return v
replies = [call(1, "hello", unhex(plan["hello"]))]
for i, desc in enumerate(plan["registers"]):
    replies.append(call(2 + i, "register", unhex(desc)))
print(json.dumps(replies, default=lambda b: b.hex()))
"""


def _hexed(v):
    if isinstance(v, dict):
        return {k: _hexed(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_hexed(x) for x in v]
    if isinstance(v, bytes):
        return "hex:" + v.hex()
    return v


def test_the_shorter_shape_attack_from_another_uid_on_the_unix_socket_is_refused(sidecar):
    """Another user reaches the socket (an operator widened it for a group of engines):
    neither the shorter shape with a zero key nor the victim's exact description, real
    key included, maps the victim's memory: the segment is not the peer's."""
    if os.getuid() != 0:
        pytest.skip("running a peer as another uid needs root")
    victim = _victim()
    opened = [sidecar.workdir, sidecar.socket.parent]
    modes = [stat.S_IMODE(os.stat(d).st_mode) for d in opened]
    for d in opened:
        os.chmod(d, 0o711)
    os.chmod(sidecar.socket, 0o666)
    try:
        before = victim.full.buffer.clone()
        layout = make_layout(MIX)
        hello = {
            "role": "engine",
            "engine_id": "uid-aimer",
            "pid": 1,
            "fingerprint": layout.fingerprint(PAGE),
            "layout": layout.to_dict(),
            "page_size": PAGE,
        }
        registers = [
            {"page_size": PAGE, **_shorter(export_pools(victim))},
            {"page_size": PAGE, **export_pools(victim)},
        ]
        plan = json.dumps({"hello": _hexed(hello), "registers": _hexed(registers)})
        proc = subprocess.run(
            [sys.executable, "-c", _ATTACKER, sidecar.endpoint, str(NOBODY)],
            input=plan,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        hello_reply, *register_replies = json.loads(proc.stdout)
        assert hello_reply["ok"], hello_reply
        for reply in register_replies:
            assert reply["ok"] is False, reply
            assert reply["error"]["code"] == "registration_refused", reply
        assert "belongs to uid" in register_replies[1]["error"]["message"]
        assert torch.equal(victim.full.buffer, before)
    finally:
        os.chmod(sidecar.socket, 0o600)
        for d, mode in zip(opened, modes):
            os.chmod(d, mode)
        victim.close()


def test_a_registration_naming_one_segment_twice_is_refused():
    victim = _victim()
    try:
        desc = export_pools(victim)
        desc["buffers"]["swa"]["shm_name"] = "/" + desc["buffers"]["full"]["shm_name"]
        with pytest.raises(RegistrationRefused, match="name the same segment"):
            map_pools(victim.layout, PAGE, desc)
    finally:
        victim.close()


@pytest.mark.parametrize("model_id", [7, ["m"], b"m", None, 1.5, {"m": 1}, True])
def test_hello_with_a_mistyped_model_id_is_bad_args_and_logs_no_traceback(sidecar, model_id):
    raw = Raw(sidecar.endpoint)
    try:
        layout = make_layout(MIX).to_dict()
        layout["model_id"] = model_id
        args = {
            "role": "engine",
            "engine_id": "typed",
            "pid": 1,
            "fingerprint": bytes(16),
            "layout": layout,
            "page_size": PAGE,
        }
        reply = raw.request("hello", args)
        assert reply["ok"] is False
        assert reply["error"]["code"] == "bad_args", reply
        assert "model_id" in reply["error"]["message"], reply
        assert "Traceback" not in sidecar.log_text()
    finally:
        raw.close()


@pytest.mark.parametrize("version", [1.0, True, "1"])
def test_a_version_that_only_equals_one_is_refused(sidecar, version):
    raw = Raw(sidecar.endpoint)
    try:
        raw.send(pack({"v": version, "id": 5, "verb": "health", "ttl_ms": 1000, "args": {}}))
        reply = raw.recv()
        assert reply is not None and reply["ok"] is False, reply
        assert reply["error"]["code"] == "version_mismatch", reply
        assert reply["id"] == 5
    finally:
        raw.close()
