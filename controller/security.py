"""Who a peer is, and which files the sidecar may trust: peer credentials on the Unix
socket, and the permission rules of the disk tier's directory.

* **Peer credentials.** libzmq reads ``SO_PEERCRED`` when a peer connects over ``ipc://``
  and reports it in each message's ``Peer-Address`` property (``host:uid:gid:pid``). A
  TCP peer has none: it is never trusted to name local memory.
* **The disk path.** Stored pages derive from users' prompts: the directory is created
  0700 and its files 0600 whatever the umask; a directory that another user may write is
  refused (they could plant or swap values), one that others may read is served with a
  warning (they can read what is stored there).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache.types import ConfigError

log = logging.getLogger("hicache.security")

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


@dataclass(frozen=True)
class PeerCredentials:
    """The kernel's word on the process at the other end of a Unix socket."""

    uid: int
    gid: int
    pid: int

    @classmethod
    def of_this_process(cls) -> PeerCredentials:
        """This process's own credentials (an in-process caller is its own peer)."""
        return cls(os.geteuid(), os.getegid(), os.getpid())


def peer_credentials(frame: Any) -> PeerCredentials | None:
    """The credentials libzmq attached to a message received on an ``ipc://`` socket
    (``frame``: a ``zmq.Frame``); None when there are none (TCP, or a platform without
    ``SO_PEERCRED``)."""
    try:
        address = frame.get("Peer-Address")
    except Exception:  # no such property: libzmq built without SO_PEERCRED
        return None
    if not isinstance(address, str):
        return None
    parts = address.rsplit(":", 3)
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return None
    return PeerCredentials(int(parts[1]), int(parts[2]), int(parts[3]))


def make_private_dir(path: Path) -> None:
    """Create ``path`` (and missing parents) mode 0700 whatever the umask; an existing
    directory is left as it is (see :func:`check_private_dir`)."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=PRIVATE_DIR_MODE, parents=True)
        os.chmod(path, PRIVATE_DIR_MODE)  # mkdir's mode is filtered by the umask


def check_private_dir(path: Path, setting: str, warn: bool = True) -> None:
    """Refuse a directory that another user may write (or a file in it), or that is a
    symbolic link or belongs to another user; warn (with ``warn``) on one that others may
    read or enter. A missing directory passes (it is created 0700 when opened).
    ``setting``: the option that names it, for the messages. Raises ConfigError."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid != os.geteuid():
        problem = f"belongs to uid {st.st_uid}, not to the sidecar's user (uid {os.geteuid()})"
    elif stat.S_IMODE(st.st_mode) & 0o022:
        problem = f"is mode {stat.S_IMODE(st.st_mode):04o}: other users may write into it"
    elif writable := sorted(p.name for p in path.iterdir() if _mode_of(p) & 0o022):
        problem = f"holds files other users may write ({writable})"
    else:
        mode = stat.S_IMODE(st.st_mode)
        readable = [p.name for p in path.iterdir() if _mode_of(p) & 0o044]
        if warn and (mode & 0o055 or readable):
            what = f"mode {mode:04o}" if mode & 0o055 else f"files {sorted(readable)}"
            log.warning(
                "the disk tier %s (%s) is readable by other users (%s): they can read the "
                "cached pages, which derive from users' prompts; chmod -R go-rwx %s",
                path,
                setting,
                what,
                path,
            )
        return
    raise ConfigError(
        f"the disk tier {path} (of {setting}) {problem}, so another user could plant or "
        f"swap cached pages; give {setting} a directory of the sidecar's own user, mode 0700"
    )


def _mode_of(path: Path) -> int:
    try:
        return stat.S_IMODE(os.lstat(path).st_mode)
    except OSError:  # removed meanwhile
        return 0
