"""The remote tier's settings: its write policy and the checks of its ``remote_*`` fields.

The fields themselves live on :class:`hicache.controller.config.ControllerConfig` (so the
TOML table ``[controller]``, ``HICACHE_REMOTE_*`` and ``--set`` reach them like any
other); this module keeps their meaning and validation in one place.
"""

from __future__ import annotations

import enum
from typing import Any

from hicache.types import ConfigError


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
