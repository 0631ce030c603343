"""Controller configuration: host pool size and split, the LMDB tier, threads and timeouts.

Every size carries its unit in its name; every policy is an enum. ``validate`` raises
:class:`hicache.types.ConfigError` with a message that names the field, the bad value and
what to do.

The LMDB map size rule
----------------------
LMDB never shrinks its file and never overwrites a live page: a transaction writes new
pages and frees the old ones only after every reader that may still see them has ended.
A value larger than a database page goes to a run of contiguous *overflow* pages, and a
churning cache (pages evicted and replaced by pages of other sizes) fragments the free
list, so the file grows past the live data. With ``lmdb_map_size_bytes=None`` the map
is ``2 × disk_budget_bytes + 64 MiB``: room for a full budget of live values, the same
again for freed-but-not-yet-reusable and fragmented runs, and a fixed margin for the
B-tree's own pages and small budgets. An explicit map size must be at least
``1.25 × disk_budget_bytes``; below that the map fills before the budget does and
every write turns into an evict-and-retry.
"""

from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache.config import parse_enum
from hicache.controller.settings import config_from_dict, config_to_dict, parse_size
from hicache.types import ComponentType, ConfigError, Tier

MIB = 1 << 20
GIB = 1 << 30

_MAP_MARGIN_BYTES = 64 * MIB
_MIN_MAP_RATIO = 1.25


# -- the remote tier's settings: its write policy and the checks of its remote_* fields --


class RemoteWritePolicy(enum.Enum):
    """Which host pages a node writes to the remote tier."""

    # Every page that reaches host (a backup or a disk read): another node finds it as
    # soon as the write lands. Pages are content-addressed, so nodes never coordinate.
    WRITE_THROUGH = "write_through"
    # Only pages that served a load-back on this node: less traffic, hot prefixes only.
    SELECTIVE = "selective"
    # When the host tier evicts a page (its bytes are copied out, never waited on).
    ON_HOST_EVICTION = "on_host_eviction"
    OFF = "off"  # read the remote tier, never write it


_POSITIVE_SECONDS = (
    "remote_lookup_timeout_s",
    "remote_read_timeout_s",
    "remote_write_timeout_s",
    "remote_hint_ttl_s",
    "remote_breaker_cooldown_s",
    "remote_failure_hint_s",
    "remote_topology_refresh_s",
)
_POSITIVE_INTS = (
    "remote_write_queue_pages",
    "remote_write_batch_pages",
    "remote_read_batch_pages",
    "remote_writer_threads",
    "remote_probe_chunk_pages",
    "remote_hint_entries",
    "remote_breaker_failures",
    "remote_io_threads",
)


def validate_remote(config: Any) -> None:
    """Raise ConfigError naming the first bad ``remote_*`` value of ``config``."""
    if config.remote_url is not None:
        from hicache.controller.tiers.remote_cluster import parse_remote_url

        parse_remote_url(config.remote_url)  # raises with the reason
    for name in _POSITIVE_SECONDS:
        v = getattr(config, name)
        if not (isinstance(v, (int, float)) and v > 0):
            raise ConfigError(f"{name} must be > 0 seconds, got {v!r}")
    for name in _POSITIVE_INTS:
        v = getattr(config, name)
        if not (isinstance(v, int) and v >= 1):
            raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
    if not config.remote_key_prefix or any(c in config.remote_key_prefix for c in "{}: "):
        raise ConfigError(
            f"remote_key_prefix {config.remote_key_prefix!r} must be non-empty, without "
            "braces, colons or spaces (it starts every key; braces would move the hash tag)"
        )


# -- tenants: per-tenant quotas (controller/store/tenants.py) ----------------------------

QUOTA_TIERS = {"host": Tier.HOST, "disk": Tier.DISK}


def parse_tenant_quotas(entries: list[str]) -> dict[str, dict[Tier, int | None]]:
    """The per-tenant overrides of the setting ``tenant_quotas``: each entry
    ``NAME:TIER=SIZE`` (TIER ``host`` or ``disk``; SIZE with a unit, or ``none`` for no
    quota whatever the default). ConfigError names a malformed entry."""
    out: dict[str, dict[Tier, int | None]] = {}
    for entry in entries:
        name, sep, rest = entry.rpartition(":")
        tier, eq, size = rest.partition("=")
        if not (sep and name and eq and tier.strip() in QUOTA_TIERS):
            raise ConfigError(
                f"tenant_quotas entry {entry!r}: write NAME:host=SIZE or NAME:disk=SIZE "
                "(SIZE e.g. 512MiB, or none)"
            )
        value = None if size.strip().lower() == "none" else parse_size(size, "tenant_quotas")
        if value is not None and value <= 0:
            raise ConfigError(f"tenant_quotas entry {entry!r}: a quota must be > 0 bytes")
        out.setdefault(name, {})[QUOTA_TIERS[tier.strip()]] = value
    return out


class DiskWritePolicy(enum.Enum):
    """When a page that reached the host tier is written to the LMDB tier."""

    # Queued to the writer as soon as it lands on host: a clean restart keeps every page
    # that was ever acknowledged, and a host eviction never waits for the disk.
    WRITE_THROUGH = "write_through"
    # Written only when the host tier evicts it: less disk traffic for short-lived
    # prefixes, but a page lives only in memory until then.
    WRITE_BACK = "write_back"


class BackupAck(enum.Enum):
    """When a backup is acknowledged (the sidecar replies ``ok``): the rule is
    :meth:`LocalController.acknowledged`."""

    HOST = "host"  # the pages are in the host tier (disk writes follow asynchronously)
    DISK = "disk"  # the pages are committed to LMDB (needs write_through and a disk tier)


class HostPinning(enum.Enum):
    """Whether host pages are page-locked (pinned) for fast, asynchronous DMA."""

    AUTO = "auto"  # pinned when CUDA is available, plain memory otherwise
    PINNED = "pinned"  # pinned, or an error when it cannot be
    PAGEABLE = "pageable"  # never pinned


@dataclass
class ControllerConfig:
    """Sizes, policies, threads and timeouts of one controller (host and disk tiers).

    Host pool split: each component of the layout gets host pages in proportion to its
    ``host_weight_*`` (a *page count* ratio, not a byte ratio): with the defaults, every
    FULL page can have an SWA page beside it and one page in four a Mamba state. The
    bytes are then ``host_pool_bytes`` divided so that those page counts hold.
    """

    # Host tier: payload bytes of all host pages (each page also has a 128-byte frame).
    host_pool_bytes: int = 1 * GIB
    host_weight_full: float = 1.0
    host_weight_swa: float = 1.0
    host_weight_mamba: float = 0.25
    host_pinning: HostPinning = HostPinning.AUTO
    # Host pages in memory the sidecar's engines map read-only, so that an engine copies
    # a load-back of pages on host itself (controller/client/host_share.py). The sidecar turns
    # it on; an in-process controller has no one to share with.
    host_shared: bool = False
    # Fault every host page in when the pool is made (``MADV_POPULATE_WRITE``, several
    # threads), so that the first loads after a start do not pay the kernel's first
    # touch of each page. A pinned pool is populated anyway; the sidecar turns it on.
    host_populate: bool = False
    # A host page that served a load-back is evicted as if it had been used this many
    # host-tier lifetimes later (0: plain LRU). See controller/store/page_index.py.
    host_hit_retention_turnovers: float = 1.0
    # Why pages are missing (controller/store/miss_reasons.py): pages whose departure is
    # remembered (about 100 bytes each), and lookups kept per engine for ``explain``.
    miss_reasons_remembered_pages: int = 65536
    miss_reasons_recent_lookups: int = 32

    # Disk tier: None runs without one. The budget counts stored values (header + page).
    disk_path: str | Path | None = None
    disk_budget_bytes: int = 16 * GIB
    lmdb_map_size_bytes: int | None = None  # None: the rule in the module docstring
    disk_write_policy: DiskWritePolicy = DiskWritePolicy.WRITE_THROUGH
    disk_sync: bool = True  # fsync every commit: a crash loses nothing committed
    disk_verify_on_open: bool = False  # checksum every stored page at open (reads it all)
    disk_map_full_retries: int = 3  # evict-and-retry rounds before rejecting pages
    # The LMDB writer thread's niceness above the sidecar's (0: the same): its copying and
    # hashing yield a busy CPU to request handling and the engines' copies (Linux).
    disk_writer_nice: int = 10
    # After a start, the most recently used disk pages are read back into free host pages
    # up to this many bytes, hottest first, while serving (controller/tiers/prewarm.py).
    # None: half of host_pool_bytes; 0: off (the default in-process; the sidecar's is None).
    prewarm_bytes: int | None = 0
    # And the next hottest disk pages, up to this many bytes, are handed to the OS to read
    # into its page cache in the background (madvise WILLNEED): a restart's first loads of
    # them do not read a cold file. None: host_pool_bytes; 0: off (the default in-process;
    # the sidecar's is None).
    prewarm_disk_bytes: int | None = 0
    # Offer a disk or remote page only where loading it beats the engine's own prefill
    # of it (the rate an engine reports, or its integration measures, sent with its
    # lookups; controller/store/cost_rule.py). A tier whose pages are cut is let through
    # once per cost_rule_recheck_s seconds since its last read, to be measured again
    # (0: never).
    cost_rule: bool = True
    cost_rule_recheck_s: float = 30.0

    # The writer commits up to this many pages / bytes per transaction, waiting at most
    # the flush interval for a batch to fill; reads run on reader_threads threads (at most
    # one per CPU the process may run on; a load of pages under 64 KiB on one thread).
    writer_batch_pages: int = 64
    writer_batch_bytes: int = 64 * MIB
    writer_flush_interval_s: float = 0.002
    reader_threads: int = 4
    # A load of disk pages this large or larger (on average) has each read's pages copied
    # into the engine by the reader as the read ends, beside the reads still to come;
    # smaller ones are copied when every read has ended (controller/store/page_copies.py).
    copy_as_read_min_page_bytes: int = 64 << 10
    # true (the default): a load into an engine's CPU pools reads its pages held only on
    # disk straight into its slots (one copy, checked there), and they stay on disk only:
    # another engine's load of them reads disk again. false: they are read into host
    # pages first, and kept there. Loads into GPU pools always go through host pages
    # (controller/store/load_reads.py).
    disk_load_direct: bool = True

    # A backup issues its copies this many bytes at a time, so that on a GPU the copy of
    # one part runs while the controller books the next (0: the whole backup at once).
    # Each part costs about 0.3 ms of host time per component in it (one copy each):
    # much smaller parts cost more than they hide.
    backup_chunk_bytes: int = 64 * MIB

    pin_ttl_default_s: float = 30.0  # a pin without a ttl lasts this long
    pin_ttl_max_s: float = 600.0  # no pin lasts longer (a dead engine's pins lapse)
    load_timeout_s: float = 10.0  # load() without a timeout; backup handles' wait()
    prefetch_timeout_s: float = 5.0  # prefetch handles' wait() without a timeout
    close_timeout_s: float = 60.0  # close() waits this long for queued writes

    # Remote tier (a Valkey/Redis Cluster shared by every node): None runs without one.
    # ``redis://host:port[,host:port…]`` (seed nodes), ``rediss://`` for TLS; a user may
    # precede the hosts (``redis://cache@host:port``), the password comes from a file.
    # See controller/tiers/remote_tier.py and docs/operations.md.
    remote_url: str | None = None
    remote_password_file: str | None = None
    remote_tls_ca_file: str | None = None
    remote_key_prefix: str = "hicache"
    remote_write_policy: RemoteWritePolicy = RemoteWritePolicy.WRITE_THROUGH
    remote_fill_to_disk: bool = True  # a page read from remote is queued to LMDB too
    remote_lookup_timeout_s: float = 0.1  # a lookup's remote probe, all of it
    remote_read_timeout_s: float = 1.0  # one batch of remote reads (a load waits on it)
    remote_write_timeout_s: float = 2.0  # one batch of remote writes
    remote_write_queue_pages: int = 1024  # pages waiting to be written; beyond: dropped
    remote_write_batch_pages: int = 32
    remote_read_batch_pages: int = 16  # a load's pages are read in parallel batches
    remote_writer_threads: int = 2
    remote_probe_chunk_pages: int = 64  # pages probed per round trip of a lookup
    remote_hint_entries: int = 65536  # pages remembered as present remotely
    remote_hint_ttl_s: float = 30.0  # how long a presence hint is believed
    remote_breaker_failures: int = 3  # calls failing on every key before the breaker opens
    remote_breaker_cooldown_s: float = 1.0  # open this long, then one trial call
    remote_failure_hint_s: float = 2.0  # a failing node's keys are skipped this long
    remote_topology_refresh_s: float = 0.5  # slot map re-read this often while one fails
    remote_io_threads: int = 8

    # Tenants (controller/store/tenants.py; docs/isolation.md): the host and disk bytes
    # each tenant's pages may hold (payload bytes; None: no quota). A tenant over its quota
    # evicts its own least recently used pages, never another tenant's. ``tenant_quotas``
    # overrides them per tenant: "NAME:host=SIZE" or "NAME:disk=SIZE" (SIZE "none": none).
    tenant_host_quota_bytes: int | None = None
    tenant_disk_quota_bytes: int | None = None
    tenant_quotas: list[str] = field(default_factory=list)
    tenant_metrics_top_k: int = 10  # tenants named in the metrics; the rest sum to one

    def __post_init__(self) -> None:
        self.host_pinning = parse_enum(HostPinning, self.host_pinning, "host_pinning")
        self.disk_write_policy = parse_enum(
            DiskWritePolicy, self.disk_write_policy, "disk_write_policy"
        )
        self.remote_write_policy = parse_enum(
            RemoteWritePolicy, self.remote_write_policy, "remote_write_policy"
        )
        if self.disk_path is not None:
            self.disk_path = Path(self.disk_path)
        self.validate()

    # -- derived -------------------------------------------------------------------------

    @property
    def disk_enabled(self) -> bool:
        return self.disk_path is not None

    @property
    def remote_enabled(self) -> bool:
        return self.remote_url is not None

    @property
    def map_size_bytes(self) -> int:
        """The LMDB map size in force: explicit, or the documented default rule."""
        if self.lmdb_map_size_bytes is not None:
            size = self.lmdb_map_size_bytes
        else:
            size = 2 * self.disk_budget_bytes + _MAP_MARGIN_BYTES
        page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        return math.ceil(size / page) * page

    def host_weight(self, component: ComponentType) -> float:
        return {
            ComponentType.FULL: self.host_weight_full,
            ComponentType.SWA: self.host_weight_swa,
            ComponentType.MAMBA: self.host_weight_mamba,
        }[component]

    # -- checks --------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise ConfigError naming the first bad value and what to do about it."""
        if self.host_pool_bytes <= 0:
            raise ConfigError(
                f"host_pool_bytes must be > 0, got {self.host_pool_bytes}; give the host tier "
                "some memory, e.g. 4 GiB = 4294967296"
            )
        if self.cost_rule_recheck_s < 0:
            raise ConfigError(
                f"cost_rule_recheck_s must be >= 0 (0: never), got {self.cost_rule_recheck_s}"
            )
        if self.prewarm_bytes is not None and self.prewarm_bytes < 0:
            raise ConfigError(
                f"prewarm_bytes must be >= 0 (0: no prewarm) or none (half the host pool), "
                f"got {self.prewarm_bytes}"
            )
        if self.prewarm_disk_bytes is not None and self.prewarm_disk_bytes < 0:
            raise ConfigError(
                f"prewarm_disk_bytes must be >= 0 (0: none) or none (the host pool's size), "
                f"got {self.prewarm_disk_bytes}"
            )
        for c in ComponentType:
            w = self.host_weight(c)
            if not (w >= 0 and math.isfinite(w)):
                raise ConfigError(f"host_weight_{c.name.lower()} must be a finite number >= 0")
        if self.host_weight_full <= 0:
            raise ConfigError("host_weight_full must be > 0: FULL pages are the cache's backbone")
        r = self.host_hit_retention_turnovers
        if not (isinstance(r, (int, float)) and r >= 0 and math.isfinite(r)):
            raise ConfigError(
                f"host_hit_retention_turnovers must be a finite number >= 0 (0: plain LRU), "
                f"got {r!r}"
            )
        if self.disk_enabled:
            if self.disk_budget_bytes <= 0:
                raise ConfigError(
                    f"disk_budget_bytes must be > 0 when disk_path is set, got "
                    f"{self.disk_budget_bytes}; or set disk_path=None to run without a disk tier"
                )
            if (
                self.lmdb_map_size_bytes is not None
                and self.lmdb_map_size_bytes < _MIN_MAP_RATIO * self.disk_budget_bytes
            ):
                raise ConfigError(
                    f"lmdb_map_size_bytes={self.lmdb_map_size_bytes} is below "
                    f"{_MIN_MAP_RATIO} x disk_budget_bytes={self.disk_budget_bytes}: LMDB needs "
                    "room beyond the live data; raise it or leave it None for the default rule"
                )
        positive_ints = ("writer_batch_pages", "writer_batch_bytes", "reader_threads")
        for name in positive_ints:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.copy_as_read_min_page_bytes < 0:
            raise ConfigError(
                f"copy_as_read_min_page_bytes must be >= 0, got {self.copy_as_read_min_page_bytes}"
            )
        if self.backup_chunk_bytes < 0:
            raise ConfigError(
                f"backup_chunk_bytes must be >= 0 (0: each backup as one part), "
                f"got {self.backup_chunk_bytes}"
            )
        for name in ("miss_reasons_remembered_pages", "miss_reasons_recent_lookups"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0: none kept), got {getattr(self, name)}")
        if self.disk_map_full_retries < 0:
            raise ConfigError("disk_map_full_retries must be >= 0")
        if not 0 <= self.disk_writer_nice <= 19:
            raise ConfigError(f"disk_writer_nice must be 0..19, got {self.disk_writer_nice}")
        if self.writer_flush_interval_s < 0:
            raise ConfigError("writer_flush_interval_s must be >= 0 seconds")
        for name in (
            "pin_ttl_default_s",
            "pin_ttl_max_s",
            "load_timeout_s",
            "prefetch_timeout_s",
            "close_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        validate_remote(self)
        for name in ("tenant_host_quota_bytes", "tenant_disk_quota_bytes"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ConfigError(f"{name} must be > 0 bytes or None (no quota), got {v}")
        parse_tenant_quotas(self.tenant_quotas)  # raises naming a malformed entry
        if self.tenant_metrics_top_k < 0:
            raise ConfigError(f"tenant_metrics_top_k must be >= 0, got {self.tenant_metrics_top_k}")
        if self.pin_ttl_default_s > self.pin_ttl_max_s:
            raise ConfigError(
                f"pin_ttl_default_s={self.pin_ttl_default_s} exceeds "
                f"pin_ttl_max_s={self.pin_ttl_max_s}; lower the default or raise the maximum"
            )

    # -- (de)serialisation ---------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON/msgpack-safe description, the inverse of :meth:`from_dict`."""
        return config_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ControllerConfig:
        """Build from a mapping; unknown keys are an error (a typo must not pass silently)."""
        return config_from_dict(cls, d, "controller")
