"""A sidecar request that copies to or from the engine's pages, in flight: when its
outcome is known, and when its copy can no longer touch the pages."""

from __future__ import annotations

import time
from typing import Any, Protocol

from hicache.controller.channel import (
    POLL_SLICE_S,
    Channel,
    RemoteError,
    SidecarUnavailable,
    result_of,
)


class TransferClient(Protocol):
    """What a transfer needs of the sidecar client that sent it."""

    _channel: Channel
    _unsettled: int
    _fenced_generation: int

    def _succeeded(self) -> None: ...

    def _failed(self, exc: Exception, renew: bool = False) -> None: ...


class RemoteTransfer:
    """A backup, prefetch or abandoned load in flight: its reply says whether it succeeded.

    Its outcome is known at its reply or its deadline, whichever comes first; it is
    ``done()`` only once the sidecar can no longer touch the engine's pages for it: at the
    reply, or once a newer session is registered (the sidecar answers a registration only
    after every request of the engine's earlier sessions has ended or been refused). A
    transfer still unanswered at its deadline opens the breaker, so that the reconnect
    which follows settles it even if its reply never comes. A prefetch (``touches_device``
    False: it only reads disk into host pages) is done as soon as its outcome is known.
    """

    def __init__(
        self,
        client: TransferClient,
        req_id: int,
        generation: int,
        timeout_s: float,
        deadline: float | None = None,
        touches_device: bool = True,
    ):
        self._client = client
        self._req_id = req_id
        self._generation = generation
        self._deadline = time.monotonic() + timeout_s if deadline is None else deadline
        self._ok: bool | None = None  # the outcome, once known
        self._touches_device = touches_device
        self._settled = False  # nothing of this transfer can touch the engine's pages
        self.keep_alive: Any = None  # e.g. the CUDA event the sidecar's copy waits on
        if touches_device:
            client._unsettled += 1

    def _settle(self, ok: bool) -> None:
        self._ok = ok
        if not self._settled:
            self._settled = True
            self.keep_alive = None
            if self._touches_device:
                self._client._unsettled -= 1

    def _take_reply(self, msg: dict) -> None:
        try:
            ok = result_of(msg).ok
            self._client._succeeded()
        except RemoteError as exc:
            self._client._failed(exc)
            ok = False
        self._settle(ok)

    def done(self) -> bool:
        if self._settled:
            return True
        client = self._client
        ch = client._channel
        if ch.generation != self._generation:  # the socket it went out on is gone
            self._ok = False
            if client._fenced_generation > self._generation or not self._touches_device:
                self._settle(False)
            return self._settled
        msg = ch.poll(self._req_id)
        if msg is not None:
            self._take_reply(msg)
        elif self._ok is None and time.monotonic() > self._deadline:
            self._ok = False
            client._failed(SidecarUnavailable("transfer timed out"), renew=self._touches_device)
            if not self._touches_device:
                ch.forget(self._req_id)
                self._settle(False)
        return self._settled

    def wait(self, timeout_s: float | None = None) -> bool:
        """The outcome: True when the sidecar acknowledged the transfer, False on failure
        or at the deadline (the transfer may then still run: see ``done()``)."""
        if self.done() or self._ok is not None:
            return bool(self._ok)
        left = self._deadline - time.monotonic()
        if timeout_s is not None:
            left = min(left, timeout_s)
        end = time.monotonic() + max(left, 0.0)
        while not self.done() and self._ok is None and time.monotonic() < end:
            with self._client._channel._lock:
                self._client._channel._drain(min(POLL_SLICE_S, max(end - time.monotonic(), 0)))
        self.done()  # the deadline may have passed in the last slice
        return bool(self._ok)
