"""The sidecar's private directory and its decoder hold against another local user and
against a small message built to expand in memory.

* The socket directory is the sidecar's own (a real directory of its user, mode 0700)
  or the sidecar does not start: another user who created it first could otherwise
  replace the socket or plant the admin token. A directory of its own that others may
  enter is made 0700; an admin token that is not the sidecar's alone is replaced.
* A message within ``max_message_bytes`` decodes to a bounded number of maps and arrays:
  refused with ``bad_message`` (naming the request) instead of becoming millions of
  Python objects on the I/O thread; legitimate large requests still pass.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import tempfile
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from hicache.controller.client import AdminClient
from hicache.controller.client.channel import RemoteError
from hicache.controller.config import ControllerConfig
from hicache.controller.sidecar.config import SidecarConfig
from hicache.controller.sidecar.server import SidecarError, SidecarServer
from hicache.controller.store.local import LocalController
from hicache.controller.wire.fields import encode_refs
from hicache.controller.wire.protocol import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ErrorCode,
    ProtocolError,
    Verb,
    decode_request,
    encode_request,
)
from hicache.controller_api import PageRef
from hicache.types import ComponentType
from tests.controller.sidecar.test_sidecar_badinput import Raw
from tests.support.cache import make_layout
from tests.support.sidecar import START_TIMEOUT_S, Sidecar, layout_file, short_tmpdir, wait_for

NOBODY = 65534  # the uid another local user has in these tests
MIX = "full"
PAGE = 4
LIMIT = 65536


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _give_to_another_user(path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("making a file of another user needs root")
    os.chown(path, NOBODY, NOBODY, follow_symlinks=False)


@contextlib.contextmanager
def _server(socket_path: Path) -> Iterator[SidecarServer]:
    """An in-process sidecar, not yet bound."""
    ctl = LocalController(ControllerConfig(host_pool_bytes=1 << 20, disk_path=None))
    srv = SidecarServer(ctl, SidecarConfig(socket_path=socket_path, metrics_port=0))
    try:
        yield srv
    finally:
        srv._shutdown_sockets()
        ctl.close()


# -- the socket directory -------------------------------------------------------------------


def _run_dir_of_another_user(workdir: Path) -> Path:
    """A socket directory that another user created first, as they would leave it."""
    if os.getuid() == 0:
        d = workdir / "run"
        d.mkdir()
        os.chmod(d, 0o777)
        os.chown(d, NOBODY, NOBODY)
        return d
    tmp = Path(tempfile.gettempdir())  # e.g. /tmp: root's, open to everyone
    if tmp.stat().st_uid == os.getuid():
        pytest.skip("no directory of another user to try")
    return tmp


def test_a_sidecar_refuses_to_serve_from_a_directory_of_another_user(workdir):
    run = _run_dir_of_another_user(workdir)
    sc = Sidecar(workdir, args=["--no-disk"])
    sc.socket = run / f"hc-{workdir.name}.sock"
    sc.launch()
    try:
        wait_for(
            lambda: sc.proc.poll() is not None or sc.ready_file.exists(),
            START_TIMEOUT_S,
            "the sidecar to start or exit",
        )
        assert sc.proc.wait(30) == 1, f"it served from {run}:\n{sc.log_tail()}"
        log = sc.log_text()
        assert str(run) in log and f"uid {run.stat().st_uid}" in log, log
        assert not sc.socket.exists()
    finally:
        sc.stop()
        sc.kill()


def test_a_loose_directory_of_its_own_is_made_private_and_a_planted_token_replaced(workdir):
    run = workdir / "run"
    run.mkdir()
    os.chmod(run, 0o777)
    planted = b"another-user-knows-this-token-0123456789"
    (run / "admin.token").write_bytes(planted)
    os.chmod(run / "admin.token", 0o644)
    _give_to_another_user(run / "admin.token")
    args = ["--no-disk", "--layout-file", str(layout_file(workdir, MIX, PAGE))]
    with Sidecar(workdir, args=args) as sc:
        assert _mode(run) == 0o700
        token_stat = os.lstat(run / "admin.token")
        assert token_stat.st_uid == os.getuid() and _mode(run / "admin.token") == 0o600
        assert (run / "admin.token").read_bytes().strip() != planted
        admin = sc.admin()  # reads the token the sidecar wrote
        assert admin.call(Verb.HEALTH)["status"] == "ok"
        admin.close()
        with pytest.raises(RemoteError) as refused:
            AdminClient(sc.endpoint, token=planted, timeout_s=10)
        assert refused.value.code == ErrorCode.FORBIDDEN.value
        log = sc.log_text()
        assert "was mode 0777; made it 0700" in log and "not trusted" in log, log


@pytest.mark.parametrize("kind", ["symbolic link", "file"])
def test_a_socket_directory_that_is_not_a_real_directory_is_refused(workdir, kind):
    real = workdir / "elsewhere"
    real.mkdir(mode=0o700)
    run = workdir / "run"
    if kind == "symbolic link":
        run.symlink_to(real)
        words = "is a symbolic link"
    else:
        run.write_bytes(b"")
        words = "is not a directory"
    with _server(run / "hicache.sock") as srv, pytest.raises(SidecarError) as refused:
        srv.bind()
    assert str(run) in str(refused.value) and words in str(refused.value)
    assert not (real / "hicache.sock").exists() and not (real / "admin.token").exists()


def test_a_private_directory_and_its_token_are_kept_as_they_are(workdir, caplog):
    run = workdir / "run"
    with _server(run / "hicache.sock") as srv:
        srv.bind()
        first = srv.admin_token
    assert _mode(run) == 0o700 and _mode(run / "admin.token") == 0o600
    with caplog.at_level(logging.WARNING, "hicache.sidecar"), _server(run / "hicache.sock") as srv:
        srv.bind()
        assert srv.admin_token == first  # kept across restarts
    assert not caplog.records


@pytest.mark.timeout(60)  # a FIFO read the old way blocks the start for good
@pytest.mark.parametrize("kind", ["readable by others", "symbolic link", "fifo"])
def test_an_admin_token_that_is_not_the_sidecars_alone_is_replaced(workdir, kind, caplog):
    run = workdir / "run"
    run.mkdir(mode=0o700)
    token = run / "admin.token"
    known = b"somebody-else-has-read-this-token-0123"
    target = workdir / "target.token"
    if kind == "readable by others":
        token.write_bytes(known)
        os.chmod(token, 0o644)
    elif kind == "symbolic link":
        target.write_bytes(known)
        os.chmod(target, 0o600)
        token.symlink_to(target)
    else:
        os.mkfifo(token, 0o600)  # would block a plain open for reading
    with caplog.at_level(logging.WARNING, "hicache.sidecar"), _server(run / "hicache.sock") as srv:
        srv.bind()
        assert srv.admin_token != known and len(srv.admin_token) == 64
        assert token.read_bytes().strip() == srv.admin_token
    assert stat.S_ISREG(os.lstat(token).st_mode) and _mode(token) == 0o600
    assert any("not trusted" in r.getMessage() for r in caplog.records)
    if kind == "symbolic link":
        assert target.read_bytes() == known  # the file it pointed to is left alone


# -- bounded decoding -----------------------------------------------------------------------


def _envelope_around(arg_value: bytes, req_id: int = 1) -> bytes:
    """A heartbeat whose one argument is ``arg_value`` (raw msgpack bytes)."""
    head = {"v": 1, "id": req_id, "verb": "heartbeat", "ttl_ms": 1000}
    return (
        b"\x85"
        + b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in head.items())
        + msgpack.packb("args")
        + b"\x81"
        + msgpack.packb("x")
        + arg_value
    )


def _array(n: int, items: bytes) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big") + items


def _empty_maps(size: int) -> bytes:
    """A message of ``size`` bytes: one array of empty maps (one byte each)."""
    n = size - len(_envelope_around(_array(0, b"")))
    return _envelope_around(_array(n, b"\x80" * n))


def _nested_empty_maps(size: int) -> bytes:
    """The same, cut into arrays of 1000 maps: no single container is long."""
    inner = b"\xdc" + (1000).to_bytes(2, "big") + b"\x80" * 1000
    n = (size - len(_envelope_around(_array(0, b"")))) // len(inner)
    return _envelope_around(_array(n, inner * n))


def _maps_of_empty_arrays(size: int) -> bytes:
    inner = b"\x8f" + b"".join(msgpack.packb(chr(97 + i)) + b"\x90" for i in range(15))
    n = (size - len(_envelope_around(_array(0, b"")))) // len(inner)
    return _envelope_around(_array(n, inner * n))


@pytest.mark.parametrize("bomb", [_empty_maps, _nested_empty_maps, _maps_of_empty_arrays])
def test_a_small_message_cannot_expand_into_millions_of_objects(bomb):
    limit = 1 << 20
    msg = bomb(limit)
    assert len(msg) <= limit  # passes the size check
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError) as refused:
            decode_request(msg, limit)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert refused.value.code is ErrorCode.BAD_MESSAGE
    assert "maps and arrays" in refused.value.message
    assert refused.value.request_id == 1  # the reply can name the request
    assert peak < 16 * limit, f"decoding {len(msg)} bytes took {peak >> 20} MiB"


def test_a_map_of_too_many_entries_is_refused_by_name():
    entries = b"".join(msgpack.packb(f"k{i}") + b"\xc0" for i in range(5000))
    msg = _envelope_around(b"\xdf" + (5000).to_bytes(4, "big") + entries, req_id=3)
    with pytest.raises(ProtocolError) as refused:
        decode_request(msg, DEFAULT_MAX_MESSAGE_BYTES)
    assert refused.value.code is ErrorCode.BAD_MESSAGE and "max_map_len" in refused.value.message
    assert refused.value.request_id == 3


def test_an_oversized_request_is_refused_by_name():
    msg = encode_request(7, Verb.LOOKUP, {"hashes": b"\x01" * 1024}, 1.0)
    with pytest.raises(ProtocolError) as refused:
        decode_request(msg, 512)
    assert refused.value.code is ErrorCode.TOO_LARGE and refused.value.request_id == 7


def test_legitimate_requests_at_the_size_limit_still_decode():
    limit = DEFAULT_MAX_MESSAGE_BYTES
    # pin_prefix: real token ids take 3 or 5 bytes each; fixints (1 byte) are the densest.
    tokens = [100_000 + i % 50_000 for i in range(3_000_000)]
    dense = list(range(100)) * 150_000
    n_pages = (limit - 256) // 16
    refs = [PageRef(ComponentType.FULL, b"h" * 16, b"p" * 16, i) for i in range(20_000)]
    requests = [
        (Verb.PIN_PREFIX, {"tokens": tokens, "ttl_s": 60.0}),
        (Verb.PIN_PREFIX, {"tokens": dense, "ttl_s": 60.0}),
        (Verb.LOOKUP, {"hashes": b"\x01" * 16 * n_pages, "components": [0, 1, 2]}),
        (Verb.BACKUP, {"refs": encode_refs(refs)}),
    ]
    for verb, args in requests:
        msg = encode_request(9, verb, args, 1.0)
        assert len(msg) <= limit, verb
        assert decode_request(msg, limit).args == args, verb


# -- over the wire --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sidecar():
    work = short_tmpdir()
    sc = Sidecar(
        work,
        args=[
            "--no-disk",
            "--layout-file",
            str(layout_file(work, MIX, PAGE)),
            "--set",
            f"max_message_bytes={LIMIT}",
        ],
    )
    sc.start()
    yield sc
    sc.stop()
    shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize("bomb", [_empty_maps, _nested_empty_maps])
def test_a_bomb_gets_bad_message_and_the_connection_serves_on(sidecar, bomb):
    raw = Raw(sidecar.endpoint)
    try:
        assert raw.hello(engine_id=f"bomb-{bomb.__name__}", layout=make_layout(MIX))["ok"]
        raw.send(bomb(LIMIT))
        reply = raw.recv()
        assert reply is not None and reply["id"] == 1, reply
        assert reply["ok"] is False and reply["error"]["code"] == "bad_message", reply
        assert "maps and arrays" in reply["error"]["message"]
        assert raw.request("heartbeat", {}, req_id=2)["ok"]
        raw.request("bye", {}, req_id=3)
    finally:
        raw.close()


def test_a_request_past_the_limit_is_answered_not_left_to_time_out(sidecar):
    admin = sidecar.admin()
    admin.timeout_s = 10.0
    try:
        tokens = list(range(1000, 1000 + LIMIT))  # 3 bytes each: past the limit
        with pytest.raises(RemoteError) as refused:
            admin.call(Verb.PIN_PREFIX, {"tokens": tokens, "ttl_s": 60.0})
        assert refused.value.code == ErrorCode.TOO_LARGE.value
        assert "split the request" in str(refused.value)
        fits = tokens[: LIMIT // 4]
        assert admin.call(Verb.PIN_PREFIX, {"tokens": fits, "ttl_s": 60.0})["pages"] == 0
    finally:
        admin.close()
