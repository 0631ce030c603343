"""Configuration of the sidecar process: sockets, authentication, leases, limits, metrics.

The controller's own settings (host pool, LMDB, policies) are
:class:`hicache.controller.config.ControllerConfig`; ``hicache serve`` reads both, plus an
optional model layout, from one TOML file (see :mod:`hicache.controller.sidecar.process`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache.config import parse_enum
from hicache.controller.config import BackupAck
from hicache.controller.settings import config_from_dict, config_to_dict
from hicache.controller.wire.protocol import (
    ADMIN_TOKEN_NAME,
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_MAX_MESSAGE_BYTES,
    SOCKET_NAME,
    default_runtime_dir,
)
from hicache.types import ConfigError

__all__ = ["BackupAck", "SidecarConfig", "TcpAuth"]

# A Unix socket path longer than this does not fit ``sockaddr_un.sun_path``.
MAX_SOCKET_PATH_CHARS = 107


class TcpAuth(enum.Enum):
    """How TCP connections authenticate (TCP is never served without one of these)."""

    NONE = "none"  # only valid while tcp_endpoint is unset
    CURVE = "curve"  # ZeroMQ CURVE: encrypted, client keys listed in a directory
    TOKEN = "token"  # ZeroMQ PLAIN with a shared token: authenticated, not encrypted


@dataclass
class SidecarConfig:
    """Everything about the sidecar process that is not the controller's tiers."""

    socket_path: str | Path | None = None  # None: <runtime dir>/hicache.sock
    tcp_endpoint: str | None = None  # e.g. "tcp://10.0.0.5:5557"; None: no TCP
    tcp_auth: TcpAuth = TcpAuth.NONE
    tcp_token_file: str | Path | None = None
    curve_secret_key_file: str | Path | None = None  # the server's key pair (zmq cert)
    curve_authorized_keys_dir: str | Path | None = None  # clients' public key certs
    admin_token_file: str | Path | None = None  # None: admin.token beside the socket
    lease_s: float = 15.0
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_request_ttl_s: float = 600.0
    worker_threads: int = 4
    max_inflight_requests: int = 1024
    backup_ack: BackupAck = BackupAck.HOST
    drain_timeout_s: float = 60.0
    gpu_uuids: list[str] = field(default_factory=list)  # empty: every visible GPU
    metrics_port: int = 9464  # 0: no metrics endpoint
    metrics_addr: str = "127.0.0.1"
    log_level: str = "info"
    # KV events (kv_events.py): the PUB endpoint (None: off), e.g. "tcp://*:5557" or
    # "ipc:///run/hicache/events.sock", and a ROUTER endpoint answering replays.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_batch_interval_s: float = 0.01
    kv_events_batch_max_events: int = 4096
    kv_events_queue_events: int = 100_000  # past it an event is dropped (and counted)
    kv_events_buffer_batches: int = 10_000  # kept for replays
    kv_events_hwm: int = 100_000  # ZeroMQ send high-water mark, per subscriber
    # The model's sliding window in tokens, sent with SWA pages' events (the layout does
    # not carry it); None: left out.
    kv_events_sliding_window: int | None = None

    def __post_init__(self) -> None:
        self.tcp_auth = parse_enum(TcpAuth, self.tcp_auth, "tcp_auth")
        self.backup_ack = parse_enum(BackupAck, self.backup_ack, "backup_ack")
        for name in (
            "socket_path",
            "tcp_token_file",
            "curve_secret_key_file",
            "curve_authorized_keys_dir",
            "admin_token_file",
        ):
            v = getattr(self, name)
            if v is not None:
                setattr(self, name, Path(v).expanduser())
        self.validate()

    @property
    def socket(self) -> Path:
        """The Unix socket path in force."""
        return Path(self.socket_path) if self.socket_path else default_runtime_dir() / SOCKET_NAME

    @property
    def admin_token_path(self) -> Path:
        if self.admin_token_file:
            return Path(self.admin_token_file)
        return self.socket.parent / ADMIN_TOKEN_NAME

    def validate(self) -> None:
        """Raise ConfigError naming the first bad value and what to do about it."""
        if len(str(self.socket)) > MAX_SOCKET_PATH_CHARS:
            raise ConfigError(
                f"socket_path {str(self.socket)!r} is longer than {MAX_SOCKET_PATH_CHARS} "
                "characters, the Unix socket limit; choose a shorter path"
            )
        if self.tcp_endpoint is not None:
            if not self.tcp_endpoint.startswith("tcp://"):
                raise ConfigError(f"tcp_endpoint {self.tcp_endpoint!r} must start with tcp://")
            if self.tcp_auth is TcpAuth.NONE:
                raise ConfigError(
                    "tcp_endpoint is set but tcp_auth is 'none': TCP is only served with "
                    "authentication; set tcp_auth to 'curve' or 'token'"
                )
            if self.tcp_auth is TcpAuth.TOKEN and not self.tcp_token_file:
                raise ConfigError("tcp_auth='token' needs tcp_token_file (a file with the token)")
            if self.tcp_auth is TcpAuth.CURVE and not (
                self.curve_secret_key_file and self.curve_authorized_keys_dir
            ):
                raise ConfigError(
                    "tcp_auth='curve' needs curve_secret_key_file (the server's key pair) and "
                    "curve_authorized_keys_dir (the clients' public keys)"
                )
        for name in ("lease_s", "heartbeat_interval_s", "max_request_ttl_s", "drain_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.heartbeat_interval_s * 2 > self.lease_s:
            raise ConfigError(
                f"heartbeat_interval_s={self.heartbeat_interval_s} must be at most half of "
                f"lease_s={self.lease_s}, or one late heartbeat would drop an engine"
            )
        if self.max_message_bytes < 4096:
            raise ConfigError("max_message_bytes must be >= 4096")
        for name in ("worker_threads", "max_inflight_requests"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError(
                f"metrics_port must be 0 (off) or a TCP port, got {self.metrics_port}"
            )
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            v = getattr(self, name)
            if v is not None and not v.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(f"{name}={v!r}: write tcp://HOST:PORT or ipc://PATH")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ConfigError("kv_events_replay_endpoint needs kv_events_endpoint")
        if not self.kv_events_batch_interval_s > 0:
            raise ConfigError("kv_events_batch_interval_s must be > 0 seconds")
        for name in (
            "kv_events_batch_max_events",
            "kv_events_queue_events",
            "kv_events_buffer_batches",
            "kv_events_hwm",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level={self.log_level!r}: use debug, info, warning or error")

    def to_dict(self) -> dict[str, Any]:
        """A JSON/msgpack-safe description (paths as strings, enums by value)."""
        return config_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SidecarConfig:
        return config_from_dict(cls, d, "sidecar")
