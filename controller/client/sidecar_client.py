"""``SidecarController``: the engine's client of the sidecar, a :class:`CacheController`.

It keeps the engine serving whatever the sidecar does:

* every request has a deadline (``SidecarClientConfig``); a lookup's is short;
* a **circuit breaker** opens after ``breaker_failures`` consecutive failures (timeouts,
  an unreachable socket, a sidecar that forgot the session). While it is open, no
  request is sent: lookups are misses, backups and loads fail at once, and the engine
  recomputes from its device tier;
* a background thread sends heartbeats while the engine is idle, and while the breaker is
  open tries every ``reconnect_interval_s`` to reconnect: a fresh socket, the handshake
  and the registration of the device pools again (a restarted sidecar knows nothing of
  the engine). The breaker closes when that succeeds.

Nothing here runs per decode step: the tree calls the sidecar at match time (only when
its device prefix is short of the query), when it backs a prefix up, and at load-back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.controller.client.channel import (
    FATAL_CODES,
    Channel,
    RemoteError,
    RemoteLayoutMismatch,
    SidecarClientConfig,
    SidecarUnavailable,
    result_of,
)
from hicache.controller.client.engine_copies import EngineCopies
from hicache.controller.client.inflight import (
    LOAD_PINS,
    RemoteTransfer,
    current_stream,
    sidecar_load,
    split_load,
)
from hicache.controller.wire.fields import MAX_LOOKUP_HASHES, MAX_PIN_KEYS
from hicache.controller.wire.protocol import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    ErrorCode,
    Role,
    Verb,
    default_endpoint,
    normalize_endpoint,
)
from hicache.controller.wire.verbs import (
    BackupArgs,
    HelloArgs,
    KeysArgs,
    LookupArgs,
    NoArgs,
    RegisterArgs,
    UnpinArgs,
)
from hicache.controller_api import (
    CompletedTransfer,
    ControllerError,
    LoadResult,
    LookupResult,
    PageKey,
    PageRef,
    PinReceipt,
    Presence,
    TransferHandle,
)
from hicache.types import ComponentType

if TYPE_CHECKING:
    from hicache.controller.client.host_share import HostShare, WritableHostPages
    from hicache.layout import ModelLayout
    from hicache.pools import DevicePools

__all__ = ["RemoteError", "RemoteLayoutMismatch", "SidecarClientConfig"]
__all__ += ["SidecarController", "SidecarUnavailable"]

log = logging.getLogger("hicache.sidecar.client")


class SidecarController(EngineCopies):
    """The :class:`CacheController` protocol over the sidecar (see the module docstring)."""

    def __init__(
        self,
        endpoint: str | os.PathLike | None = None,
        engine_id: str | None = None,
        config: SidecarClientConfig | None = None,
        start_heartbeats: bool = True,
    ) -> None:
        self.endpoint = normalize_endpoint(endpoint) if endpoint else default_endpoint()
        self.engine_id = engine_id or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.config = config or SidecarClientConfig()
        self.counters: Counter[str] = Counter()
        self._channel = Channel(self.endpoint, self.config)
        self._state_lock = threading.Lock()
        self._failures = 0
        self._open = True  # no session until register() handshakes
        self._next_attempt = 0.0
        # (layout, page_size, exported buffers); the buffers are None for a session that
        # only looks up and pins (attach), which never registers memory.
        self._registration: tuple[ModelLayout, int, dict[str, Any] | Callable | None] | None = None
        self._device: Any = None
        self._pools: DevicePools | None = None
        self._share: HostShare | None = None  # the sidecar's host pages, mapped here
        # The same pages mapped read-write, for an engine that copies its own stores and
        # loads (map_host_pages), and the session generation they belong to.
        self._pages: WritableHostPages | None = None
        self._pages_generation = -1
        self._instance: tuple[int, int | None] = (-1, None)  # (generation, sidecar instance)
        self._heartbeat_s = self.config.heartbeat_interval_s or DEFAULT_HEARTBEAT_INTERVAL_S
        self._hb_pending: int | None = None
        self._hb_sent = 0.0
        self._closed = False
        self._unsettled = 0  # transfers sent whose end the sidecar has not confirmed
        # Transfers sent on a socket generation below this one are settled: a newer
        # session's registration was answered, which the sidecar does only once every
        # request of the engine's earlier sessions has ended or been refused.
        self._fenced_generation = 0
        self._wake = threading.Event()
        self._start_heartbeats = start_heartbeats
        self._thread: threading.Thread | None = None
        self.prefill_rate = self.config.prefill_tokens_per_s  # tokens/s, sent with lookups
        self.measured_prefill_rate: float | None = None  # sent while prefill_rate is None

    def report_prefill_rate(self, tokens_per_s: float | None, measured: bool = False) -> None:
        """Tokens/s, sent with the next lookups (the sidecar's cost rule); a ``measured``
        one (hicache/prefill_rate.py) counts only while ``prefill_rate`` is None."""
        if measured:
            self.measured_prefill_rate = tokens_per_s
        else:
            self.prefill_rate = tokens_per_s

    # -- breaker -------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """True while the breaker is closed (requests are sent)."""
        return not self._open

    def _succeeded(self) -> None:
        self._failures = 0

    def _failed(self, exc: Exception, renew: bool = False) -> None:
        """Count a failure; open the breaker after enough of them (at once for a lost
        session, which only a reconnect can fix, and with ``renew`` for a transfer given up
        on: only a new session proves that it can no longer run)."""
        lost = renew or (isinstance(exc, RemoteError) and exc.code == ErrorCode.NO_SESSION.value)
        with self._state_lock:
            self._failures += 1
            if not self._open and (lost or self._failures >= self.config.breaker_failures):
                self._open = True
                self._next_attempt = time.monotonic()
                self.counters["breaker_opened"] += 1
                self._keep_disk_reads()  # no disk page read here until a new session
                log.warning(
                    "sidecar %s unavailable (%s); serving from the device tier until it is back",
                    self.endpoint,
                    exc,
                )
                self._wake.set()

    def _call(self, verb: Verb, args: Any, timeout_s: float, spin: bool = False) -> Any:
        """The reply record to ``args`` (the verb's argument record); raises
        SidecarUnavailable while the breaker is open, RemoteError for a refusal. ``spin``:
        a call on the engine's critical path (``reply_spin_s``)."""
        if self._open:
            self.counters[f"{verb.value}_skipped"] += 1
            raise SidecarUnavailable(f"the sidecar at {self.endpoint} is unavailable")
        try:
            spin_s = self.config.reply_spin_s if spin else 0.0
            res = self._channel.call(verb, args, timeout_s, spin_s=spin_s)
        except (SidecarUnavailable, RemoteError) as exc:
            self._call_failed(exc)
            raise
        self._succeeded()
        return res

    def _call_failed(self, exc: SidecarUnavailable | RemoteError) -> None:
        if isinstance(exc, SidecarUnavailable) or exc.code in (
            ErrorCode.NO_SESSION.value,
            ErrorCode.SHUTTING_DOWN.value,
            ErrorCode.BUSY.value,
            ErrorCode.DEADLINE_EXCEEDED.value,
        ):
            self._failed(exc)

    # -- session -------------------------------------------------------------------------

    def _connect(self) -> None:
        """Fresh socket, handshake, registration; raises on failure."""
        layout, page_size, desc = self._registration
        ch = self._channel
        if callable(desc):
            desc = desc()  # at each session: a restarted sidecar holds no descriptors
        ch.reset()
        t = self.config.connect_timeout_s
        hello = HelloArgs(
            role=Role.ENGINE.value,
            engine_id=self.engine_id,
            pid=os.getpid(),
            fingerprint=layout.fingerprint(page_size),
            layout=layout,
            page_size=page_size,
        )
        welcome = ch.call(Verb.HELLO, hello, t, connect_wait_s=t)
        self._instance = (ch.generation, welcome.instance)
        if self.config.heartbeat_interval_s is None:
            self._heartbeat_s = welcome.heartbeat_interval_s
        if desc is not None:
            register = RegisterArgs(page_size, desc["device"], desc["buffers"])
            if ch.call(Verb.REGISTER, register, max(t, self.config.register_timeout_s)).fenced:
                self._fenced_generation = ch.generation
        self._drop_share(keep=True)  # an earlier session's host pages are not this one's
        if desc is not None and self.config.engine_copies:
            reads = self.config.engine_disk_reads and welcome.pid != os.getpid()  # one env
            reads = self.config.engine_split_read_bytes if reads else None
            self._share = self._open_share(layout, page_size, ch.generation, reads)
        with self._state_lock:
            self._open = False
            self._failures = 0
        self.counters["connected"] += 1
        log.info("connected to the sidecar at %s as %s", self.endpoint, self.engine_id)

    def _try_reconnect(self) -> None:
        try:
            self._connect()
        except RemoteError as exc:
            if exc.code in FATAL_CODES:
                log.error("the sidecar refused this engine: %s", exc)
            self._next_attempt = time.monotonic() + self.config.reconnect_interval_s
        except (SidecarUnavailable, ControllerError):
            self._next_attempt = time.monotonic() + self.config.reconnect_interval_s

    def _background(self) -> None:
        tick = min(0.1, self.config.reconnect_interval_s / 2)
        while not self._closed:
            self._wake.wait(tick)
            self._wake.clear()
            if self._closed:
                return
            now = time.monotonic()
            if self._open:
                self._expire_kept_disk(now)
                if now >= self._next_attempt:
                    self._try_reconnect()
                continue
            self._heartbeat(now)

    def _heartbeat(self, now: float) -> None:
        ch = self._channel
        if self._hb_pending is not None:
            msg = ch.poll(self._hb_pending)
            if msg is not None:
                self._hb_pending = None
                try:
                    result_of(msg)
                    self._succeeded()
                except RemoteError as exc:
                    self._failed(exc)
            elif now - self._hb_sent > self.config.request_timeout_s:
                ch.forget(self._hb_pending)
                self._hb_pending = None
                self._failed(SidecarUnavailable("heartbeat unanswered"))
            return
        if now - ch.last_reply >= self._heartbeat_s:
            try:
                self._hb_pending = ch.send(Verb.HEARTBEAT, NoArgs(), self.config.request_timeout_s)
                self._hb_sent = now
            except SidecarUnavailable as exc:
                self._failed(exc)

    # -- the protocol --------------------------------------------------------------------

    def register(self, layout: ModelLayout, page_size: int, pools: DevicePools) -> None:
        """Hand the sidecar the engine's pools. Raises ControllerError for what no retry
        fixes (another layout, memory the sidecar cannot map); an unreachable sidecar is
        not an error: the client keeps trying in the background."""
        if pools.config.page_size != page_size:
            raise ControllerError(
                f"page_size={page_size} but the pools use {pools.config.page_size}"
            )
        from hicache.controller.client.device_share import export_pools

        self._registration = (layout, page_size, export_pools(pools))
        self._device, self._pools = pools.full.buffer.device, pools
        self._start_session()

    def register_described(
        self, layout: ModelLayout, page_size: int, describe: Callable[[], dict[str, Any]]
    ) -> None:
        """Register CPU memory the caller describes (``{"device": "cpu", "buffers": ...}``,
        e.g. memfd buffers whose descriptors ``describe`` hands over on the descriptor
        socket). ``describe()`` runs at every session; it raises SidecarUnavailable when it
        cannot reach the sidecar. Raises as :meth:`register` does."""
        self._registration = (layout, page_size, describe)
        self._start_session()

    def attach(self, layout: ModelLayout, page_size: int) -> None:
        """A session that looks pages up and pins them but registers no memory (an engine's
        scheduler, whose workers register theirs). Raises as :meth:`register` does."""
        self._registration = (layout, page_size, None)
        self._start_session()

    def _start_session(self) -> None:
        try:
            self._connect()
        except RemoteError as exc:
            if exc.code in FATAL_CODES:
                raise
            self._next_attempt = time.monotonic() + self.config.reconnect_interval_s
        except SidecarUnavailable as exc:
            log.warning("sidecar %s not reachable at start (%s); will retry", self.endpoint, exc)
            self._next_attempt = time.monotonic() + self.config.reconnect_interval_s
        if self._start_heartbeats and self._thread is None:
            self._thread = threading.Thread(
                target=self._background, name="hicache-sidecar-client", daemon=True
            )
            self._thread.start()

    def lookup(
        self, page_hashes: Sequence[bytes], components: Sequence[ComponentType], tenant=None
    ) -> LookupResult:
        """Presence per component; all misses when the sidecar is unavailable. A chain
        longer than the sidecar takes in one lookup is asked in parts. ``tenant`` (a
        str): whose lookup it is (the sidecar counts it to that tenant)."""
        try:
            parts: dict[ComponentType, list[np.ndarray]] = {c: [] for c in components}
            rate = self.prefill_rate or self.measured_prefill_rate
            for start in range(0, max(len(page_hashes), 1), MAX_LOOKUP_HASHES):
                chunk = page_hashes[start : start + MAX_LOOKUP_HASHES]
                res = self._call(
                    Verb.LOOKUP,
                    LookupArgs(b"".join(chunk), list(components), tenant, rate),
                    self.config.lookup_timeout_s,
                    spin=True,
                )
                for comp, raw in zip(components, res.presence):
                    pres = np.frombuffer(raw, dtype=np.int8)
                    if pres.size != len(chunk):
                        raise ControllerError("lookup reply has the wrong length")
                    parts[comp].append(pres)
            return LookupResult({c: np.concatenate(p) for c, p in parts.items()})
        except (ControllerError, KeyError, TypeError) as exc:
            self.counters["lookup_misses_unavailable"] += 1
            log.debug("lookup answered as a miss: %s", exc)
            return LookupResult(
                {c: np.full(len(page_hashes), Presence.ABSENT, np.int8) for c in components}
            )

    def _cuda_device(self) -> Any:
        """The engine's CUDA device when its pools are on one, else None."""
        desc = None if self._registration is None else self._registration[2]
        if not isinstance(desc, dict) or desc.get("device") != "cuda":
            return None
        return self._device

    def backup(
        self, refs: Sequence[PageRef], ready_event: Any = None, tenant: str | None = None
    ) -> TransferHandle:
        """Start a backup; the handle's ``wait`` is True once the sidecar acknowledged it
        (pages on host, or committed to disk with ``backup_ack = "disk"``). New pages are
        ``tenant``'s (the sidecar's per-tenant quotas).

        On CUDA the sidecar's copy waits on an interprocess event recorded on the engine's
        current stream (after ``ready_event``), so the engine does not block here.
        """
        if self._open or not refs:
            return CompletedTransfer(not refs)
        ready_handle, keep_alive = None, None
        device = self._cuda_device()
        if device is not None:
            from hicache.controller.client.device_share import export_ready_event

            try:
                ready_handle, keep_alive = export_ready_event(device)
            except Exception as exc:  # no IPC events here: finish the engine's work first
                log.debug("interprocess event unavailable (%s); synchronizing", exc)
                (ready_event or current_stream(device)).synchronize()
        timeout = self.config.backup_timeout_s
        try:
            rid = self._channel.send(Verb.BACKUP, BackupArgs(refs, ready_handle, tenant), timeout)
        except SidecarUnavailable as exc:
            self._failed(exc)
            return CompletedTransfer(False)
        handle = RemoteTransfer(self, rid, self._channel.generation, timeout)
        handle.keep_alive = keep_alive
        return handle

    def pin(self, keys: Sequence[PageKey], ttl_s: float) -> PinReceipt | None:
        """Pin ``keys`` for ``ttl_s``; None when a page is absent or the sidecar is
        unavailable. With ``pin_at_load`` nothing is sent: the receipt tells :meth:`load`
        to pin the pages it loads (an absent page then fails the load instead)."""
        if len(keys) > MAX_PIN_KEYS:  # one pin holds one load: a prefix this long misses
            self.counters["pin_too_large"] += 1
            log.warning(
                "a pin of %d keys is over the sidecar's %d: a miss", len(keys), MAX_PIN_KEYS
            )
            return None
        if self.config.pin_at_load:
            if self._open:
                self.counters["pin_skipped"] += 1
                return None
            deadline = time.monotonic() + ttl_s
            return PinReceipt(LOAD_PINS, list(keys), deadline, generation=self._channel.generation)
        try:
            args = self._pin_args(keys, ttl_s)
            res = self._call(Verb.PIN, args, self.config.request_timeout_s, True)
        except ControllerError as exc:
            log.debug("pin failed: %s", exc)
            return None
        return self._receipt(res, keys, ttl_s, self._channel.generation)

    def load(self, refs: Sequence[PageRef], pin: PinReceipt, timeout_s: float) -> LoadResult:
        """``ok`` when every page was copied, here or by the sidecar (``sidecar_load``: no
        answer in time is a failure whose ``pending`` is done once no copy can write)."""
        if pin.generation != self._channel.generation:
            return LoadResult.FAILED  # pinned on a session that is gone
        if self._open:
            self.counters["load_skipped"] += 1
            return LoadResult.FAILED
        share = self._share  # pages all on host: copied here (host_share.py)
        mine = share is not None and share.generation == pin.generation
        pages = share.host_pages(pin, refs, share.disk) if mine else None  # None: the sidecar's
        if pages is not None and (parts := share.split(refs, pages)) is not None:
            return split_load(self, share, parts, pin, timeout_s)  # read here and there
        copied = None if pages is None else share.try_load(refs, pin, self.counters, pages)
        if copied is not None:
            self.counters["load_engine_copied" if copied else "load_engine_copy_failed"] += 1
            return LoadResult.LOADED if copied else LoadResult.FAILED
        return sidecar_load(self, refs, pin, timeout_s)

    def unpin(self, pin: PinReceipt, loaded_s: float | None = None) -> None:
        """Release ``pin``, not waiting for the answer (docs/protocol.md: a lost unpin
        only lets the pin lapse at its deadline; later requests see it released).
        ``loaded_s``: the caller copied the pinned pages itself, in that long."""
        if pin.generation != self._channel.generation or self._open or pin.pin_id == LOAD_PINS:
            return  # released with its session, or a load's own pin (released by the load)
        share = self._share
        args = UnpinArgs(pin.pin_id, loaded_s) if share is None else share.unpin_args(pin, loaded_s)
        timeout = self.config.request_timeout_s
        try:
            self._channel.send(Verb.UNPIN, args, timeout, reply_wanted=False)
        except SidecarUnavailable as exc:
            log.debug("unpin not sent (the pin expires on its own): %s", exc)

    def prefetch(self, keys: Sequence[PageKey]) -> TransferHandle:
        if self._open or not keys:
            return CompletedTransfer(not keys)
        timeout = self.config.request_timeout_s
        try:
            rid = self._channel.send(Verb.PREFETCH, KeysArgs(list(keys)), timeout)
        except SidecarUnavailable as exc:
            self._failed(exc)
            return CompletedTransfer(False)
        return RemoteTransfer(self, rid, self._channel.generation, timeout, touches_device=False)

    def stats(self) -> dict[str, Any]:
        """The sidecar's stats plus this client's, or only the client's when unavailable."""
        client = {
            "available": self.available,
            "counters": dict(self.counters),
            "unsettled_transfers": self._unsettled,
        }
        try:
            out = self._call(Verb.STATS, NoArgs(), self.config.request_timeout_s)
        except ControllerError:
            return {"client": client}
        out["client"] = client
        return out

    def close(self) -> None:
        """Say goodbye (the sidecar releases this engine's pins) and close the socket."""
        if self._closed:
            return
        if not self._open:
            with contextlib.suppress(ControllerError):
                self._channel.call(Verb.BYE, NoArgs(), min(1.0, self.config.request_timeout_s))
        self._closed = True
        self._drop_share()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._channel.close()
