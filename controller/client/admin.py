"""The admin client: an authenticated admin connection to a sidecar, each request checked
against the verb table before it is sent (``hicachectl`` and engine integrations use it)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from hicache.controller.client.channel import (
    Channel,
    RemoteError,
    SidecarClientConfig,
    SidecarUnavailable,
)
from hicache.controller.wire.protocol import (
    ADMIN_TOKEN_NAME,
    ErrorCode,
    ProtocolError,
    Role,
    Verb,
    default_endpoint,
    normalize_endpoint,
    socket_dir,
)
from hicache.controller.wire.verbs import SPECS, HelloArgs, NoArgs
from hicache.types import ConfigError


class AdminClient:
    """An admin connection to a sidecar (handshake with the admin token)."""

    def __init__(
        self,
        endpoint: str | None = None,
        token: bytes | None = None,
        token_file: str | os.PathLike | None = None,
        timeout_s: float = 10.0,
        config: SidecarClientConfig | None = None,
    ) -> None:
        self.endpoint = normalize_endpoint(endpoint) if endpoint else default_endpoint()
        self.timeout_s = timeout_s
        sock_dir = socket_dir(self.endpoint)
        if sock_dir is not None and not Path(self.endpoint[len("ipc://") :]).exists():
            raise SidecarUnavailable(
                f"the sidecar is not reachable: no socket at {self.endpoint[len('ipc://') :]} "
                "(is it running? is --socket right?)"
            )
        if token is None:
            path = Path(token_file) if token_file else None
            if path is None and sock_dir is not None:
                path = sock_dir / ADMIN_TOKEN_NAME
            if path is None:
                raise ConfigError("a TCP admin connection needs --token-file")
            try:
                token = path.read_bytes().strip()
            except OSError as exc:
                raise PermissionError(
                    f"cannot read the admin token {path} ({exc.strerror}); run as the "
                    "sidecar's user or pass --token-file"
                ) from None
        self._token = token
        self._channel = Channel(self.endpoint, config or SidecarClientConfig())
        self._handshake()

    def _handshake(self) -> None:
        self._channel.reset()
        hello = HelloArgs(
            role=Role.ADMIN.value, engine_id=f"hicachectl:{os.getpid()}", token=self._token
        )
        self._channel.call(Verb.HELLO, hello, self.timeout_s, connect_wait_s=self.timeout_s)

    def call(self, verb: Verb, args: dict[str, Any] | None = None, progress: Any = None) -> dict:
        """One request, its arguments checked and its reply decoded against the verb's
        spec (a bad argument is refused here, as the sidecar would); the reply as a map.
        A session the sidecar forgot (idle past its lease, or a restart) is renewed once."""
        spec = SPECS[verb]
        try:
            record = spec.decode_args(args or {})
        except ProtocolError as exc:
            raise RemoteError(exc.code.value, exc.message) from None
        try:
            reply = self._channel.call(verb, record, self.timeout_s, progress)
        except RemoteError as exc:
            if exc.code != ErrorCode.NO_SESSION.value:
                raise
            self._handshake()
            reply = self._channel.call(verb, record, self.timeout_s, progress)
        return spec.encode_reply(reply)

    def clear(
        self, tiers: tuple[str, ...] = ("host", "disk"), all_namespaces: bool = False
    ) -> dict:
        """Drop pages from the sidecar's ``tiers`` (this connection's namespace unless
        ``all_namespaces``); the sidecar's reply."""
        return self.call(Verb.CLEAR, {"tiers": list(tiers), "all_namespaces": all_namespaces})

    def close(self) -> None:
        with contextlib.suppress(RemoteError, SidecarUnavailable):
            self._channel.call(Verb.BYE, NoArgs(), 1.0)
        self._channel.close()
