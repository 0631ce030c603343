"""Admin operations on a :class:`LocalController`: clear, evict, prefix pins, fsck and
residency; the controller's methods of those names call them.

These are the sidecar's admin verbs. They work on the controller's page store under its
lock, with the same rules as the controller's own evictions: a pinned or busy page is
never dropped, and chains are cut from the tail (a page whose child is still present in
a tier stays there), so what an admin clears never leaves a cached chain without its
head.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import lmdb

from hicache.controller.store.counters import Failure, component_label
from hicache.controller.store.page_codec import (
    HEADER_BYTES,
    KEY_BYTES,
    decode_header,
    payload_checksum,
)
from hicache.controller.store.page_index import DiskState, HostState, PageEntry
from hicache.controller.wire.security import PRIVATE_FILE_MODE
from hicache.controller_api import ControllerError, PageKey, PinReceipt
from hicache.keys import namespace_hash, page_hashes
from hicache.types import ComponentType, Tier

if TYPE_CHECKING:
    import threading

    from hicache.controller.config import ControllerConfig
    from hicache.controller.store.counters import Counters
    from hicache.controller.store.page_store import PageStore

log = logging.getLogger(__name__)


class Controller(Protocol):
    """What the admin operations use of a :class:`LocalController` (whose methods
    ``clear``, ``evict``, ``pin_prefix``, ``fsck``, … call these functions)."""

    config: ControllerConfig
    counters: Counters
    opening_lock: threading.Lock

    @property
    def store(self) -> PageStore: ...

    def pin(
        self, keys: list[PageKey], ttl_s: float | None = None, engine_id: str = ...
    ) -> PinReceipt | None: ...

    def unpin(self, pin: PinReceipt, engine_id: str = ...) -> None: ...


ADMIN_ENGINE = "admin"  # the owner of pins made by hicachectl
_REPAIR_WAIT_S = 30.0  # how long an admin command waits for its deletes to be committed
_FSCK_BATCH = 1024  # values per read transaction: a long read would pin old LMDB pages


def _entries_deepest_first(ctl: Controller, namespace_root: bytes | None) -> list[PageEntry]:
    """Entries (every component) ordered so that a page comes before its chain parent;
    only those under ``namespace_root`` when given. Lock held by the caller."""
    index = ctl.store.index
    entries = list(index)
    fulls = {e.page_hash: e for e in entries if e.component is ComponentType.FULL}
    children: dict[bytes, list[bytes]] = {}
    for e in fulls.values():
        children.setdefault(e.parent_hash, []).append(e.page_hash)
    if namespace_root is not None:
        roots = [namespace_root]
    else:
        roots = list({e.parent_hash for e in fulls.values() if e.parent_hash not in fulls})
    order: list[bytes] = []
    frontier = roots
    seen: set[bytes] = set()
    while frontier:  # breadth first: parents before children
        nxt = []
        for h in frontier:
            for c in children.get(h, ()):
                if c not in seen:
                    seen.add(c)
                    order.append(c)
                    nxt.append(c)
        frontier = nxt
    rank = {h: i for i, h in enumerate(order)}
    if namespace_root is None:  # aux pages whose FULL page is gone still belong to "all"
        scoped = entries
    else:
        scoped = [e for e in entries if e.page_hash in rank]
    # Deepest first; at equal depth the aux pages (SWA/Mamba) before their FULL page.
    return sorted(
        scoped,
        key=lambda e: (-rank.get(e.page_hash, -1), e.component is ComponentType.FULL),
    )


def _drop_disk_locked(ctl: Controller, e: PageEntry) -> list[bytes]:
    index = ctl.store.index
    group = [e]
    if e.component is ComponentType.FULL:
        group = [*index.aux_in(e, Tier.DISK), e]
    keys = []
    for x in group:
        if x.disk_state is not DiskState.READY or x.pins or x.busy:
            continue
        index.clear_disk(x)
        keys.append(x.skey)
        ctl.counters.inc("evictions", "disk", component_label(x.component))
        index.discard_if_unused(x)
    return keys


@dataclass
class ClearResult:
    host_pages: int = 0
    disk_pages: int = 0
    kept_pages: int = 0  # in scope but pinned, busy, or the head of a kept page

    def to_dict(self) -> dict[str, int]:
        return {
            "host_pages": self.host_pages,
            "disk_pages": self.disk_pages,
            "kept_pages": self.kept_pages,
        }


def clear(
    ctl: Controller,
    fingerprint: bytes | None,
    tiers: Iterable[Tier],
    namespace: str | None = None,
    all_namespaces: bool = True,
) -> ClearResult:
    """Drop every unpinned page of ``tiers`` (in ``namespace`` unless ``all_namespaces``).

    Pinned and in-flight pages are kept, and so are the chain heads above them.
    """
    tiers = set(tiers)
    store = ctl.store
    out = ClearResult()
    if store.host is None:
        return out
    root = None
    if not all_namespaces:
        if fingerprint is None:
            return out
        root = namespace_hash(fingerprint, namespace)
    deletes: list[bytes] = []
    with store.lock:
        store.expire_pins_locked()
        for e in _entries_deepest_first(ctl, root):
            if Tier.HOST in tiers and e.attached and e.host_state is HostState.READY:
                if store.index.evictable(e, Tier.HOST):
                    before = store.host[e.component].used_pages
                    store.evict_host_locked(e)
                    out.host_pages += before - store.host[e.component].used_pages
                else:
                    out.kept_pages += 1
            if Tier.DISK in tiers and store.disk is not None and e.attached:
                if e.disk_state is DiskState.READY and store.index.evictable(e, Tier.DISK):
                    keys = _drop_disk_locked(ctl, e)
                    deletes += keys
                    out.disk_pages += len(keys)
                elif e.disk_state is not DiskState.NONE:
                    out.kept_pages += 1
        if deletes:
            store.disk.submit_delete(deletes)
        if all_namespaces and not out.kept_pages and store.index.events is not None:
            store.index.events.cleared(frozenset(tiers))
    if deletes:
        _wait_for_deletes(store, len(deletes))
    return out


def _wait_for_deletes(store, count: int) -> bool:
    """Wait until the writer has committed the ``count`` deletes just queued, so that what
    an admin command reports gone is gone from LMDB (a check or a crash right after it
    does not find it again). False when the writer did not get to them within the wait;
    they stay queued and are committed later.

    The caller queues the deletes under ``store.lock``, in the section that drops the
    keys from the index: a backup of the same page queued after that section is then
    committed after the delete, never deleted by it.
    """
    if store.disk.flush(_REPAIR_WAIT_S):
        return True
    log.warning("%d LMDB deletes still queued after %ss", count, _REPAIR_WAIT_S)
    return False


def evict(
    ctl: Controller, tier: Tier, nbytes: int, component: ComponentType | None = None
) -> dict[str, int]:
    """Evict least-recently-used pages of ``tier`` until ``nbytes`` are freed (or nothing
    evictable is left). Host eviction is per component (FULL when none is given)."""
    store = ctl.store
    if store.host is None:
        return {"pages": 0, "bytes": 0}
    if tier is Tier.DISK:
        if store.disk is None:
            raise ControllerError("this sidecar has no disk tier")
        with store.lock:
            before = store.index.disk_live_bytes
            keys = store.evict_disk(nbytes)
            store.disk.submit_delete(keys)
            freed = before - store.index.disk_live_bytes
        if keys:
            _wait_for_deletes(store, len(keys))
        return {"pages": len(keys), "bytes": freed}
    comps = [component] if component is not None else list(store.host.components)
    freed_pages = freed_bytes = 0
    with store.lock:
        store.expire_pins_locked()
        for comp in comps:
            while freed_bytes < nbytes:
                victim = store.index.pop_victim(Tier.HOST, comp)
                if victim is None:
                    break
                before = {c: store.host[c].used_pages for c in store.host.components}
                store.evict_host_locked(victim)
                for c, used in before.items():
                    n = used - store.host[c].used_pages
                    freed_pages += n
                    freed_bytes += n * store.host[c].page_bytes
    return {"pages": freed_pages, "bytes": freed_bytes}


def prefix_keys(
    ctl: Controller,
    fingerprint: bytes,
    page_size: int,
    tokens: list[int],
    namespace: str | None,
) -> list[PageKey]:
    """Keys of the leading pages of a prefix that the controller holds, every component."""
    hashes = page_hashes(tokens, fingerprint, page_size, namespace)
    keys: list[PageKey] = []
    index = ctl.store.index
    with ctl.store.lock:
        for h in hashes:
            full = index.get(h + bytes((int(ComponentType.FULL),)))
            if full is None or not full.held:
                break
            keys.append(full.key)
            for c in (ComponentType.SWA, ComponentType.MAMBA):
                aux = index.get(h + bytes((int(c),)))
                if aux is not None and aux.held:
                    keys.append(aux.key)
    return keys


def pin_prefix(ctl: Controller, keys: list[PageKey], ttl_s: float) -> PinReceipt | None:
    """Pin ``keys`` as the admin for ``ttl_s`` (capped by the controller's pin_ttl_max_s)."""
    if not keys:
        return None
    return ctl.pin(keys, ttl_s, engine_id=ADMIN_ENGINE)


def unpin(ctl: Controller, pin_id: int) -> None:
    ctl.unpin(PinReceipt(pin_id, [], 0.0), engine_id=ADMIN_ENGINE)


@dataclass
class FsckResult:
    checked: int = 0
    ok: int = 0
    corrupt: int = 0
    foreign: int = 0
    repaired: int = 0
    # Sound values whose layout digest was not compared: no layout was known (no engine
    # had registered and the sidecar's config names none). ``ok`` counts them too.
    layout_unchecked: int = 0

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def _verdict(skey: bytes, value: Any, digest: bytes | None) -> str:
    """``corrupt`` (bad header, length or checksum), ``foreign`` (another layout) or
    ``ok``, for one LMDB value; with no ``digest`` the layout is not compared."""
    hdr = decode_header(value) if len(skey) == KEY_BYTES else None
    if (
        hdr is None
        or int(hdr.component) != skey[-1]
        or len(value) != HEADER_BYTES + hdr.payload_nbytes
    ):
        return "corrupt"
    if digest is not None and hdr.layout_digest != digest:
        return "foreign"
    if payload_checksum(value[HEADER_BYTES:]) != hdr.checksum:
        return "corrupt"
    return "ok"


def _scan(
    env: lmdb.Environment,
    digest: bytes | None,
    out: FsckResult,
    progress: Callable[[int, int], None] | None,
) -> list[bytes]:
    """Check every value of ``env`` in short read transactions (a long one would pin old
    pages); counts into ``out`` and returns the keys of the corrupt values."""
    total = env.stat()["entries"]
    bad: list[bytes] = []
    last: bytes | None = None
    while True:
        batch = 0
        with env.begin(buffers=True) as txn:
            cur = txn.cursor()
            more = cur.set_range(last) if last is not None else cur.first()
            if more and last is not None and bytes(cur.key()) == last:
                more = cur.next()
            while more and batch < _FSCK_BATCH:
                skey, value = bytes(cur.key()), cur.value()
                last = skey
                batch += 1
                out.checked += 1
                verdict = _verdict(skey, value, digest)
                if verdict == "corrupt":
                    bad.append(skey)
                elif verdict == "foreign":
                    out.foreign += 1
                else:
                    out.ok += 1
                more = cur.next()
        if progress is not None:
            progress(out.checked, max(total, out.checked))
        if batch < _FSCK_BATCH:
            break
    out.corrupt = len(bad)
    if digest is None:
        out.layout_unchecked = out.ok
    if bad:
        log.warning("fsck: %d corrupt values of %d", len(bad), out.checked)
    return bad


def fsck(
    ctl: Controller,
    repair: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> FsckResult:
    """Read every LMDB value and check its header and payload checksum.

    A value of another layout is counted as foreign (never served, not corrupt). With
    ``repair``, corrupt values are dropped from the index and deleted from LMDB (a page
    in flight is left to the read path, which never serves a bad checksum either);
    ``repaired`` counts the deletes committed when the call returns.
    ``progress(done, total)`` is called every few hundred values.

    Before any engine has registered (the tiers are not open) the environment is opened
    on its own and checked the same way, the layout digest aside (``layout_unchecked``);
    a registration waits until that check has ended.
    """
    store = ctl.store
    if store.disk is None:
        if not ctl.config.disk_enabled:
            return FsckResult()
        with ctl.opening_lock:
            if store.disk is None:
                return _fsck_unopened(ctl, repair, progress)
    out = FsckResult()
    env = store.disk.env
    digest = store.disk.layout_digest
    bad = _scan(env, digest, out, progress)
    if repair and bad:
        deletes = []
        with store.lock, env.begin(buffers=True) as txn:
            for skey in bad:
                now = txn.get(skey)
                if now is None or _verdict(skey, now, digest) != "corrupt":
                    continue  # gone, or stored again since the scan: not ours to delete
                e = store.index.get(skey)
                if e is not None:
                    if e.busy or e.disk_state is not DiskState.READY:
                        continue
                    store.index.clear_disk(e)
                    store.index.discard_if_unused(e)
                ctl.counters.fail(Failure.CHECKSUM)
                deletes.append(skey)
            store.disk.submit_delete(deletes)
        # Repaired means gone from LMDB, not only queued.
        if deletes and _wait_for_deletes(store, len(deletes)):
            left = store.disk.pending_deletes  # deletes the writer must retry
            out.repaired = sum(1 for k in deletes if k not in left)
    return out


def _fsck_unopened(
    ctl: Controller, repair: bool, progress: Callable[[int, int], None] | None
) -> FsckResult:
    """fsck of a disk tier no layout has opened (``ctl.opening_lock`` held): nothing else
    in this process uses the environment, so corrupt values are deleted directly."""
    out = FsckResult()
    path = Path(ctl.config.disk_path)
    if not (path / "data.mdb").exists():
        return out
    env = lmdb.open(
        str(path),
        map_size=ctl.config.map_size_bytes,
        subdir=True,
        create=False,
        readonly=not repair,
        readahead=False,
        max_dbs=0,
        mode=PRIVATE_FILE_MODE,
    )
    try:
        bad = _scan(env, None, out, progress)
        if repair and bad:
            with env.begin(write=True, buffers=True) as txn:
                for skey in bad:
                    now = txn.get(skey)
                    if now is not None and _verdict(skey, now, None) == "corrupt":
                        txn.delete(skey)
                        out.repaired += 1
            ctl.counters.fail(Failure.CHECKSUM, out.repaired)
    finally:
        env.close()
    return out


def residency(ctl: Controller) -> dict[str, dict[str, dict[str, int]]]:
    """Pages per tier and component: ``resident`` (held there) and ``pinned`` (the part of
    resident that an active pin holds)."""
    store = ctl.store
    out: dict[str, dict[str, dict[str, int]]] = {"host": {}, "disk": {}}
    with store.lock:
        if store.host is None:
            return out
        store.expire_pins_locked()
        for c, pool in store.host.components.items():
            out["host"][component_label(c)] = {"resident": pool.used_pages, "pinned": 0}
        if store.disk is not None:
            for c, n in store.index.disk_pages.items():
                if c in store.host.components:
                    out["disk"][component_label(c)] = {"resident": n, "pinned": 0}
        pinned: dict[int, PageEntry] = {}
        for rec in store.pins.records():
            for e in rec.entries:
                pinned[id(e)] = e
        for e in pinned.values():
            label = component_label(e.component)
            if e.host_state is HostState.READY:
                out["host"][label]["pinned"] += 1
            if e.disk_state is DiskState.READY and label in out["disk"]:
                out["disk"][label]["pinned"] += 1
    return out
