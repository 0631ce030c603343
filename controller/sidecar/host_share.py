"""The sidecar's half of host-page sharing: the description and descriptors it hands an
engine over the descriptor socket (the engine's half, which maps them and copies its own
load-backs, is :mod:`hicache.controller.client.host_share`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgpack

from hicache.controller.client.host_share import SHARE_VERSION

if TYPE_CHECKING:
    from hicache.controller.store.local import LocalController


def describe(ctl: LocalController) -> tuple[bytes, list[int]] | None:
    """The sidecar's host pages for an engine to map: a msgpack description and one
    descriptor per component (the sender keeps its own); None when they are not shared
    or not built yet."""
    store = ctl.store
    host = store.host
    if host is None or any(p.shared is None for p in host.components.values()):
        return None
    comps = list(host.components.items())
    header = {
        "version": SHARE_VERSION,
        "fingerprint": host.layout.fingerprint(host.page_size),
        "components": [
            {"component": c.name.lower(), "pages": p.num_pages, "row_bytes": p.row_bytes}
            for c, p in comps
        ],
    }
    return msgpack.packb(header), [p.shared.fd for _, p in comps]
