"""The descriptor socket (controller/client/fd_pass.py) and memfd registration (device_share):
a pool in anonymous shared memory reaches the sidecar by SCM_RIGHTS, under a ticket only
its sender can redeem, and is mapped only when its size and owner agree."""

from __future__ import annotations

import mmap
import os
import socket
import subprocess
import sys

import pytest
import torch

from hicache.controller.client.fd_pass import send_fds
from hicache.controller.sidecar import fd_inbox
from hicache.controller.sidecar.device_map import RegistrationRefused, map_pools
from hicache.controller.sidecar.fd_inbox import FdInbox
from hicache.controller.wire.security import PeerCredentials
from hicache.layout import LayerKind, ModelLayout

PAGE = 4
LAYOUT = ModelLayout(
    (LayerKind.FULL, LayerKind.FULL), num_kv_heads=2, head_dim=8, dtype=torch.float16
)
SHAPE = [2, 2, 8 * PAGE, 2, 8]  # [2, layers, slots, heads, head_dim]
NBYTES = 2 * 2 * 8 * PAGE * 2 * 8 * 2
ME = PeerCredentials.of_this_process()


@pytest.fixture
def inbox(tmp_path):
    box = FdInbox(tmp_path / "hicache.sock.fd")
    yield box
    box.close()


def _memfd(nbytes: int = NBYTES) -> int:
    fd = os.memfd_create("test-pool")
    os.ftruncate(fd, nbytes)
    return fd


def _desc(ticket: bytes, shape: list[int] = SHAPE) -> dict:
    return {
        "device": "cpu",
        "buffers": {
            "full": {
                "kind": "memfd",
                "ticket": ticket,
                "dtype": "float16",
                "shape": shape,
                "offset": 0,
            }
        },
    }


def test_a_memfd_reaches_the_sidecar_and_is_mapped_as_the_same_memory(inbox):
    fd = _memfd()
    (ticket,) = send_fds(inbox.path, [fd])
    mapped = map_pools(LAYOUT, PAGE, _desc(ticket), peer=ME, fd_inbox=inbox)
    ours = mmap.mmap(fd, NBYTES)
    ours[:4] = b"\x01\x02\x03\x04"
    full = mapped.buffers.full_kv
    assert list(full.shape) == SHAPE
    assert bytes(full.flatten()[:2].view(torch.uint8).numpy()) == b"\x01\x02\x03\x04"
    full.view(-1)[-1] = 7.0  # the sidecar's write lands in the engine's memory
    assert torch.frombuffer(ours, dtype=torch.float16)[-1].item() == 7.0
    del full
    mapped.buffers = None
    assert mapped.close()
    ours.close()
    os.close(fd)


def test_a_ticket_is_redeemed_once_and_only_by_its_sender(inbox):
    fd = _memfd()
    (ticket,) = send_fds(inbox.path, [fd])
    other = PeerCredentials(ME.uid, ME.gid, ME.pid + 1)
    with pytest.raises(RegistrationRefused, match="ticket"):
        map_pools(LAYOUT, PAGE, _desc(ticket), peer=other, fd_inbox=inbox)
    mapped = map_pools(LAYOUT, PAGE, _desc(ticket), peer=ME, fd_inbox=inbox)
    with pytest.raises(RegistrationRefused, match="ticket"):
        map_pools(LAYOUT, PAGE, _desc(ticket), peer=ME, fd_inbox=inbox)
    mapped.buffers = None
    mapped.close()
    os.close(fd)


def test_a_ticket_sent_by_another_process_is_foreign(inbox):
    fd = _memfd()
    code = (
        "import os, sys; from hicache.controller.client.fd_pass import send_fds; "
        f"sys.stdout.write(send_fds({str(inbox.path)!r}, [{fd}])[0].hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, pass_fds=[fd], check=True
    ).stdout
    with pytest.raises(RegistrationRefused, match="foreign"):
        map_pools(LAYOUT, PAGE, _desc(bytes.fromhex(out)), peer=ME, fd_inbox=inbox)
    os.close(fd)


def test_memory_smaller_than_the_shape_is_refused_and_nothing_is_mapped(inbox):
    fd = _memfd(NBYTES // 2)
    (ticket,) = send_fds(inbox.path, [fd])
    with pytest.raises(RegistrationRefused, match="fewer than"):
        map_pools(LAYOUT, PAGE, _desc(ticket), peer=ME, fd_inbox=inbox)
    os.close(fd)


def test_without_a_descriptor_socket_a_memfd_buffer_is_refused():
    with pytest.raises(RegistrationRefused, match="no memory descriptors"):
        map_pools(LAYOUT, PAGE, _desc(b"x" * 16), peer=ME, fd_inbox=None)


def test_an_unredeemed_ticket_expires_and_its_descriptor_is_closed(inbox, monkeypatch):
    fd = _memfd()
    (ticket,) = send_fds(inbox.path, [fd])
    held_fd = inbox._held[ticket][0]
    monkeypatch.setattr(fd_inbox, "TICKET_TTL_S", 0.0)
    inbox._expire(float("inf"))
    assert inbox.take(ticket, ME) is None
    with pytest.raises(OSError):
        os.fstat(held_fd)
    os.close(fd)


def test_a_connection_without_descriptors_gets_no_ticket(inbox):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5.0)
        s.connect(str(inbox.path))
        s.sendall(b"F")
        assert s.recv(64) == b""  # closed unanswered
    assert not inbox._held


def test_the_socket_is_private(inbox):
    assert (os.stat(inbox.path).st_mode & 0o777) == 0o600
