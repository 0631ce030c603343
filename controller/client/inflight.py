"""A sidecar request that copies to or from the engine's pages, in flight: when its
outcome is known, and when its copy can no longer touch the pages."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from hicache.controller.client.channel import (
    POLL_SLICE_S,
    Channel,
    RemoteError,
    SidecarUnavailable,
    result_of,
    yield_cpu,
)
from hicache.controller.wire.protocol import Verb
from hicache.controller.wire.verbs import LoadArgs
from hicache.controller_api import LoadResult, PageRef, PinReceipt

if TYPE_CHECKING:
    from hicache.controller.client.host_share import HostShare

log = logging.getLogger("hicache.sidecar.client")
LOAD_PINS = 0  # the pin id of a pin left to the load (pin_at_load); the sidecar's start at 1


def current_stream(device: Any) -> Any:
    import torch

    return torch.cuda.current_stream(device)


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
        # A handle dropped unread (a best-effort prefetch) leaves no reply behind: once
        # nobody can take it, the channel forgets the request (its ids never repeat).
        weakref.finalize(self, client._channel.forget, req_id)

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
            self._client._channel.wait_input(min(POLL_SLICE_S, max(end - time.monotonic(), 0)))
        self.done()  # the deadline may have passed in the last slice
        return bool(self._ok)


def sidecar_load(
    client: Any, refs: Sequence[PageRef], pin: PinReceipt, timeout_s: float
) -> LoadResult:
    """A load-back the sidecar copies into ``client``'s (a SidecarController's) pages:
    ``ok`` when it copied every page. When no answer came in time, the copy may still run:
    the result is then a failure whose ``pending`` handle is done once it can no longer
    write (the reply, or a newer session)."""
    return start_sidecar_load(client, refs, pin, timeout_s)()


def start_sidecar_load(
    client: Any, refs: Sequence[PageRef], pin: PinReceipt, timeout_s: float
) -> Callable[[], LoadResult]:
    """:func:`sidecar_load` sent now, not waited for: the returned call waits for it (once)
    and answers as :func:`sidecar_load` does, meanwhile this thread does something else."""
    device = client._cuda_device()
    if device is not None:
        # Work the engine queued on these slots (their previous owner's) must finish
        # before the sidecar overwrites them; a load blocks the engine anyway.
        current_stream(device).synchronize()
    ch = client._channel
    timeout = timeout_s + client.config.load_timeout_margin_s
    if pin.pin_id == LOAD_PINS:  # the load pins its pages for what is left of the TTL
        ttl = pin.deadline - time.monotonic()
        if ttl <= 0:
            return _failed  # expired, as a pin would have
        args = LoadArgs(list(refs), float(timeout_s), pin_ttl_s=max(ttl, 0.001))
    else:
        args = LoadArgs(list(refs), float(timeout_s), pin_id=pin.pin_id)
    try:
        rid = ch.send(Verb.LOAD, args, timeout)
    except SidecarUnavailable as exc:  # never sent: nothing can run
        client._failed(exc)
        log.warning("load-back through the sidecar failed: %s", exc)
        return _failed
    generation, deadline = ch.generation, time.monotonic() + timeout

    def finish() -> LoadResult:
        try:
            left = max(deadline - time.monotonic(), 0.0)
            res = ch.wait(rid, left, forget=False, spin_s=client.config.reply_spin_s)
        except RemoteError as exc:
            client._call_failed(exc)
            log.warning("load-back through the sidecar failed: %s", exc)
            return LoadResult.FAILED
        except SidecarUnavailable:
            # No answer in time: the sidecar may still be copying into these slots.
            client.counters["load_abandoned"] += 1
            log.warning("load-back through the sidecar got no answer in %.3fs", timeout)
            pending = RemoteTransfer(client, rid, generation, 0.0, deadline)
            pending.done()  # past its deadline: opens the breaker for a new session
            return LoadResult(False, pending)
        client._succeeded()
        return LoadResult.LOADED if res.ok else LoadResult.FAILED

    return finish


def _failed() -> LoadResult:
    return LoadResult.FAILED


def split_load(
    client: Any,
    share: HostShare,
    parts: tuple[list[PageRef], list[PageRef], list[int]],
    pin: PinReceipt,
    timeout_s: float,
) -> LoadResult:
    """A load that the sidecar and ``client``'s engine read from disk at once, each in its
    own process (``HostShare.split``: the sidecar's part, this engine's and its host
    pages): the sidecar's part sent first, this engine's read meanwhile, then the
    sidecar's answer waited for. A part that could not be read here (a read not OK: the
    sidecar reads again and deals with a bad value) goes to the sidecar after."""
    theirs, ours, pages = parts
    finish = start_sidecar_load(client, theirs, pin, timeout_s)
    yield_cpu()  # the request's way out (libzmq's thread) before this core reads
    t0 = time.perf_counter()
    try:
        copied = share.try_load(ours, pin, client.counters, pages)
    finally:  # whatever happened here, the sidecar's part has ended (or timed out)
        t1 = time.perf_counter()
        res = finish()
    client.counters["load_split"] += 1
    if res.ok and copied is None:
        return sidecar_load(client, ours, pin, timeout_s)
    if res.ok and copied:
        if share.disk is not None:  # the next load's parts (DiskShare.observe)
            mine = sum(1 for p in pages if p < 0)
            share.disk.observe(len(theirs), mine, t1 - t0, time.perf_counter() - t1)
        return LoadResult.LOADED
    share.forget(pin)  # no load: its unpin books nothing read here
    return LoadResult.FAILED if res.ok else res
