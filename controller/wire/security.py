"""Who a peer is, and which files the sidecar may trust: peer credentials on the Unix
socket, the private socket directory and admin token, TCP authentication (CURVE or a
shared token over PLAIN), and the permission rules of the disk tier's directory.

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
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hicache.types import ConfigError, HicacheError

if TYPE_CHECKING:
    from hicache.controller.sidecar.config import SidecarConfig

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


class SidecarError(HicacheError):
    """The sidecar cannot start or serve; the message says what to do."""


# -- the socket directory and the admin token ---------------------------------------------


def private_dir(path: Path, setting: str) -> None:
    """Create ``path`` mode 0700, or check the directory that is there: the socket and
    the admin token in it are trusted only because no other user can replace them.
    Raises SidecarError for a symbolic link, a non-directory or a directory of another
    user; a directory of this user that others may enter is made 0700 (and logged).
    ``setting``: the option that put the directory there, for the messages."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=PRIVATE_DIR_MODE, parents=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid != os.getuid():
        problem = f"belongs to uid {st.st_uid}, not to the sidecar's user (uid {os.getuid()})"
    else:
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            os.chmod(path, PRIVATE_DIR_MODE)
            log.warning("the directory %s (of %s) was mode %04o; made it 0700", path, setting, mode)
        return
    raise SidecarError(
        f"the directory {path} (of {setting}) {problem}, so another user could replace the "
        f"socket or plant the admin token; remove it, or set {setting} to a path in a "
        "directory of your own"
    )


def load_admin_token(path: Path, setting: str) -> bytes:
    """The token this sidecar wrote before (kept across restarts), or a fresh one.

    An existing file is trusted only if it is a regular file of the sidecar's user that
    no other user may read or write (mode 0600 or 0400). Any other (planted by another
    user, readable by others, a symbolic link) is replaced by a fresh token (logged):
    written to a new 0600 file and renamed over it, never into the file that was there.
    """
    private_dir(path.parent, setting)
    try:
        # O_NONBLOCK: a FIFO planted there must not hang the start.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        distrust = None
    except OSError as exc:
        distrust = "a symbolic link" if path.is_symlink() else exc.strerror
    else:
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                distrust = "not a regular file"
            elif st.st_uid != os.getuid():
                distrust = f"written by uid {st.st_uid}"
            elif stat.S_IMODE(st.st_mode) & 0o077:
                distrust = f"mode {stat.S_IMODE(st.st_mode):04o}, open to other users"
            else:
                token = os.read(fd, 4096).strip()
                if len(token) >= 16:
                    return token
                distrust = None  # empty or cut short: simply write a new one
        finally:
            os.close(fd)
    if distrust:
        log.warning("admin token %s not trusted (%s); writing a new one", path, distrust)
    token = secrets.token_hex(32).encode()
    fresh = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, PRIVATE_FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), PRIVATE_FILE_MODE)
            f.write(token + b"\n")
        os.replace(fresh, path)
    except BaseException:
        fresh.unlink(missing_ok=True)
        raise
    return token


# -- TCP authentication -------------------------------------------------------------------

ZAP_DOMAIN = "hicache"


def secure_tcp(ctx: Any, router: Any, config: SidecarConfig) -> Any:
    """Make ``router`` serve only authenticated peers: CURVE (encrypted, the clients'
    keys in a directory) or PLAIN with the shared token. Returns the running ZAP
    authenticator (stop it with the socket). Raises SidecarError for a bad key or token."""
    import zmq.auth
    from zmq.auth.thread import ThreadAuthenticator

    from hicache.controller.sidecar.config import TcpAuth

    auth_log = logging.getLogger("hicache.sidecar.auth")
    auth_log.setLevel(logging.INFO)  # its debug lines would print PLAIN passwords
    auth = ThreadAuthenticator(ctx, log=auth_log)
    auth.start()
    try:
        if config.tcp_auth is TcpAuth.CURVE:
            public, secret = zmq.auth.load_certificate(str(config.curve_secret_key_file))
            if secret is None:
                raise SidecarError(
                    f"{config.curve_secret_key_file} holds no secret key; give the server's "
                    "secret certificate (zmq.auth.create_certificates writes one)"
                )
            router.curve_secretkey = secret
            router.curve_publickey = public
            router.curve_server = True
            auth.configure_curve(domain=ZAP_DOMAIN, location=str(config.curve_authorized_keys_dir))
        else:
            token = Path(config.tcp_token_file).read_text().strip()
            if len(token) < 16:
                raise SidecarError(f"the token in {config.tcp_token_file} is shorter than 16 chars")
            router.plain_server = True
            auth.configure_plain(domain=ZAP_DOMAIN, passwords={"hicache": token})
    except BaseException:
        auth.stop()
        raise
    router.zap_domain = ZAP_DOMAIN.encode()
    return auth
