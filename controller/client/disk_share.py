"""Pages only on disk that a CPU engine reads itself, straight from the sidecar's LMDB file.

Through the sidecar, a load of pages held only on disk is read and checked by the
sidecar's reader threads into the engine's slots (``disk_load_direct``): one Python
process whose interpreter lock also does every engine's bookkeeping, while the engine's
process waits for the reply. An engine whose pools are CPU memory, talking to a sidecar
of another process on this host over ``ipc://``, reads them itself instead, as it copies
the pages on host itself (:mod:`hicache.controller.client.host_share`):

* the sidecar's host-share description names its LMDB directory and the layout digest
  its values carry (``describe``'s ``disk`` entry); this engine checks the digest against
  its own layout's and opens the environment read-only (``MDB_RDONLY``: it never writes,
  and LMDB's MVCC keeps a read transaction's values whole while the sidecar writes);
* a **load** whose pin answered ``-1`` for some pages (on disk only) reads those in one
  read transaction, each value copied from the map into its slot and checked there
  (``page_codec.verify_runs``: header CRC, component, layout digest, length, and the
  payload checksum over the bytes as they lie in the slot), and copies the others from
  the shared host pages. Pages of ``engine_split_read_bytes`` (``SPLIT_PAGE_BYTES``) or
  more it reads **beside the sidecar**: their first part (``sidecar_share``) goes to
  the sidecar as a load of its own, sent first, and this engine reads the rest meanwhile
  (``inflight.split_load``). That part follows what the loads before showed
  (:meth:`DiskShare.observe`): where this engine waited for the sidecar's answer, the
  part each side would have needed to end together; where it did not, a little more
  for the sidecar. So it moves towards where the sidecar ends just before this engine,
  whatever the machine, and it is kept over a sidecar restart with the map. Each
  process's copies and checks hold its own interpreter's lock between the lock-free
  parts; two reader threads of one process mostly wait on it for each other, two
  processes keep two cores busy. While it reads, this engine gives its core away
  once the sidecar's part is sent and after each 1 MiB (``channel.yield_cpu``): a thread
  of the sidecar's that the kernel queued on this core runs then, not a time slice later;
* the **unpin** tells the sidecar how many bytes it read in how long: the sidecar counts
  the ``disk_to_device`` transfer, feeds the disk tier's read cost, and keeps the pages
  as any that served a load (LRU, the warm start's order of use).

Anything not OK (a value missing, corrupt or of another layout, an LMDB error, a map the
sidecar grew since) fails the read here, and the whole load goes through the sidecar as
before, which reads again and deals with a bad value as it always does (counted,
dropped): a wrong byte is never served. Never opened in the sidecar's own process (an
LMDB environment is opened once per process).

**Kept over a sidecar restart.** When a session ends (the sidecar stopped, restarted or
unreachable) the client keeps the environment aside (:meth:`DiskShare.keep`), reading
nothing through it, and the next session's :meth:`DiskShare.open` takes it over when
the sidecar names the same directory and its ``data.mdb`` is the same file (device and
inode): a fresh map of the file would take a page fault for each part of it a first
load touches, which a restarted sidecar's first load would pay and no later one.
Another file, another directory, another layout or no disk tier at all closes it; so do
:meth:`SidecarController.end_disk_reads`, the client's ``close`` and a sidecar away for
longer than a restart takes (``engine_copies.KEPT_DISK_MAP_S``). A read-only reader
held across the restart is what LMDB is made for: the sidecar's open finds the lock file
in use and keeps its reader table (freeing the slots of processes gone, such as a killed
sidecar's), and LMDB's MVCC keeps every value a read transaction sees whole while the
sidecar writes.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hicache.controller.client.channel import yield_cpu
from hicache.controller.store.load_reads import SlotGeometry
from hicache.controller.store.page_codec import ReadStatus, verify_runs
from hicache.types import ComponentType

if TYPE_CHECKING:
    from hicache.controller.store.host_pool import HostPool
    from hicache.controller.store.transfer_engine import EngineBuffers, TransferEngine
    from hicache.layout import ModelLayout

log = logging.getLogger("hicache.sidecar.disk_share")

_OK = ReadStatus.OK
_TAG = {c: bytes((int(c),)) for c in ComponentType}


# Pages of this size or more are read part here, part by the sidecar at the same time
# (``engine_split_read_bytes``' default). Two reader threads in one process hand the
# interpreter's lock back and forth between each page's copies and hashes, and a waiting
# thread often misses its turn: on the 2-core development box, 64 MiB of 256 KiB pages
# took 13-14 ms on two readers, as on one, sometimes 26; through the sidecar alone a load
# of them took 18-21 ms, parted 12-15 (probe runs of bench_restart's set-up, medians of
# 16 loads). Below it the pages are read here alone, one after another (the sidecar too
# reads them serially: ``SERIAL_READ_BELOW_BYTES``).
SPLIT_PAGE_BYTES = 64 << 10
# The sidecar's part of a parted load to begin with: less than half, as its part starts
# later (the request, its threads woken; 256 KiB pages, 64 MiB on the 2-core development
# box: at a half the sidecar ended ~3 ms after the engine, at 0.4 within 0.5 ms).
SIDECAR_SHARE = 0.4
SHARE_LIMITS = (0.1, 0.7)  # never all one side's: each load measures both
SHARE_GAIN = 0.25  # how far one load moves the part towards what it showed
SHARE_STEP = 0.05  # the sidecar was done first: try this much more for it
WAITED_S = 0.3e-3  # an answer waited for longer than this was not there yet
# A read here gives its core away this often (bytes read): see ``channel.yield_cpu``.
YIELD_EVERY_BYTES = 1 << 20


class DiskShare:
    """The sidecar's LMDB environment opened read-only here, and the reads out of it
    straight into this engine's slots."""

    def __init__(
        self,
        env: Any,
        digest: bytes,
        geometry: dict[ComponentType, SlotGeometry],
        nbytes: dict[ComponentType, int],
        split_bytes: int = 1 << 62,
        path: str = "",
        identity: tuple[int, int] | None = None,
    ) -> None:
        self._env: Any = env
        self.path = path  # the LMDB directory, as the sidecar named it
        # The (device, inode) of the data.mdb that ``env`` maps, taken before it opened
        # (so never a file newer than the map), or None: never kept.
        self.identity = identity
        self.kept = False  # its map taken over from an earlier session (see the module)
        self.sidecar_share = SIDECAR_SHARE  # of a parted load's pages (see the module)
        self._digest = digest
        self._spans = {c: g.spans for c, g in geometry.items()}
        self._geometry = geometry  # keeps the slots' storages mapped
        self._nbytes = nbytes
        self._lock = threading.Lock()  # a read is wholly before or after close()
        # Components whose pages are read here only beside the sidecar (see ``shares``).
        self._shared = {c for c, n in nbytes.items() if n >= split_bytes}

    @classmethod
    def open(
        cls,
        entry: Any,
        layout: ModelLayout,
        page_size: int,
        pool: HostPool,
        engine: TransferEngine,
        buffers: EngineBuffers,
        split_bytes: int = SPLIT_PAGE_BYTES,
        kept: DiskShare | None = None,
    ) -> DiskShare | None:
        """Open the disk tier that ``entry`` (the description's ``disk``) names for reads
        into ``buffers`` (pages of ``split_bytes`` or more: beside the sidecar); None
        (logged) when it is unusable here: another layout's, slots that are not CPU memory
        in whole rows, an environment that does not open. ``kept``: an earlier session's
        (:meth:`keep`), whose environment is taken over when it is of the same file, else
        closed (by the caller where this returns before it looked)."""
        if not isinstance(entry, dict):
            return None
        path, digest = entry.get("path"), entry.get("digest")
        if not isinstance(path, str) or digest != layout.fingerprint(page_size):
            log.warning("the sidecar's disk tier is not this layout's: it reads disk pages")
            return None
        geometry: dict[ComponentType, SlotGeometry] = {}
        for comp in pool.components:
            try:
                plan = engine.prepared(comp, buffers, to_host=False)
            except Exception:  # no pool of this component here
                continue
            g = SlotGeometry.of(plan, pool[comp])
            if g is not None:
                geometry[comp] = g
        if not geometry:
            return None  # large pages, slots a GPU's or not in whole rows: the sidecar reads
        nbytes = {c: layout.page_bytes(c, page_size) for c in geometry}
        map_size = entry.get("map_size")
        map_size = map_size if isinstance(map_size, int) and map_size > 0 else 0
        env = None if kept is None else kept._hand_over(path, map_size)
        if env is not None:
            log.info("reading pages only on disk here, from %s (its map kept)", path)
            share = cls(env, digest, geometry, nbytes, split_bytes, path, kept.identity)
            share.kept = True
            share.sidecar_share = kept.sidecar_share
            return share
        identity = _identity(path)
        import lmdb  # loaded here: an engine that never reads disk pages never loads it

        try:
            env = lmdb.open(
                path,
                # The sidecar's map (0: the file's size, remapped as the file outgrows it)
                map_size=map_size,
                readonly=True,
                lock=True,  # a reader slot: the sidecar's writer keeps what it reads
                create=False,
                subdir=True,
                # A load reads whole values, many pages each, of prefixes written in
                # order: the pages next to a fault are the ones read next.
                readahead=True,
                max_dbs=0,
            )
        except lmdb.Error as exc:
            log.info("cannot read the sidecar's disk tier here (%s): it reads disk pages", exc)
            return None
        log.info("reading pages only on disk here, from %s", path)
        return cls(env, digest, geometry, nbytes, split_bytes, path, identity)

    def reads(self, component: ComponentType) -> bool:
        """Whether pages of ``component`` are read here, alone or beside the sidecar."""
        return component in self._spans

    def shares(self, component: ComponentType) -> bool:
        """Whether pages of ``component`` are read here beside the sidecar, which reads
        the other part of a load at the same time."""
        return component in self._shared

    def read(self, pages: Sequence[tuple[ComponentType, bytes, int]]) -> bool:
        """Read each ``(component, page hash, slot)`` into its slot, checked there, in one
        read transaction: whether every page was OK (if not, the slots are undefined;
        nothing is read once :meth:`close` has run)."""
        digest, spans, sizes = self._digest, self._spans, self._nbytes
        with self._lock:
            env = self._env
            if env is None:
                return False
            import lmdb

            try:
                with env.begin(buffers=True) as txn:
                    get = txn.get
                    unyielded = 0
                    for comp, page_hash, slot in pages:
                        value = get(page_hash + _TAG[comp])
                        if value is None or verify_runs(
                            value, int(comp), digest, sizes[comp], spans[comp], slot
                        ) is not _OK:  # fmt: skip
                            return False
                        unyielded += sizes[comp]
                        if unyielded >= YIELD_EVERY_BYTES:  # (see yield_cpu)
                            yield_cpu()
                            unyielded = 0
            except lmdb.MapResizedError:
                env.set_mapsize(0)  # the sidecar grew the map: the next read sees it
                return False
            except (lmdb.Error, ValueError, IndexError) as exc:
                log.warning("reading disk pages here failed (%s): the sidecar reads", exc)
                return False
        return True

    def observe(self, theirs: int, ours: int, ours_s: float, waited_s: float) -> None:
        """A parted load ended: the sidecar's ``theirs`` pages and this engine's ``ours``
        read in ``ours_s``, after which its answer took ``waited_s`` more. Moves
        :attr:`sidecar_share` part of the way to the part that would have ended both
        together (see the module)."""
        if theirs <= 0 or ours <= 0 or ours_s <= 0:
            return
        share = self.sidecar_share
        if waited_s > WAITED_S:  # the sidecar's rate: its pages over all that time
            mine, its = ours / ours_s, theirs / (ours_s + waited_s)
            target = its / (mine + its)
        else:  # done before this engine by an unknown margin
            target = share + SHARE_STEP
        share += SHARE_GAIN * (target - share)
        self.sidecar_share = min(max(share, SHARE_LIMITS[0]), SHARE_LIMITS[1])

    def keep(self) -> DiskShare | None:
        """This share as its session ends, to be handed to the next session's
        :meth:`open` (see the module): no read goes through it meanwhile. None when it
        has nothing worth keeping (closed, or its file unknown)."""
        with self._lock:
            if self._env is None or self.identity is None:
                return None
            kept = DiskShare(self._env, self._digest, {}, {}, 0, self.path, self.identity)
            kept.sidecar_share = self.sidecar_share
            self._env = None  # reads through this one return False from now on
        return kept

    def _hand_over(self, path: str, map_size: int) -> Any:
        """The environment, for a share of ``path`` whose ``data.mdb`` is still the file
        it maps, as far as ``map_size`` (then no longer this share's); None otherwise,
        closed first (one environment of a file at a time in a process: closing one
        releases the locks of the other)."""
        with self._lock:
            env = self._env
            same = path == self.path and _identity(path) == self.identity
            if env is not None and same and env.info()["map_size"] >= map_size:
                self._env = None
                return env
        self.close()
        return None

    def close(self) -> None:
        """Close the environment (its map, its reader slot); later reads return False."""
        with self._lock:
            env, self._env = self._env, None
        if env is not None:
            env.close()


def _identity(path: str) -> tuple[int, int] | None:
    """The (device, inode) of the ``data.mdb`` in ``path``: the same pair is the same
    file, however it was renamed or rewritten in place."""
    try:
        st = os.stat(os.path.join(path, "data.mdb"))
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino
