"""The sidecar's half of host-page sharing: the description and descriptors it hands an
engine over the descriptor socket (the engine's half, which maps them and copies its own
load-backs, is :mod:`hicache.controller.client.host_share`), and where its LMDB disk tier
is, for an engine that reads pages only on disk itself
(:mod:`hicache.controller.client.disk_share`)."""

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
    shared = ctl.store.shared_host_pages()
    if shared is None:
        return None
    header = {
        "version": SHARE_VERSION,
        "fingerprint": shared.fingerprint,
        "components": [
            {"component": c.component.name.lower(), "pages": c.pages, "row_bytes": c.row_bytes}
            for c in shared.components
        ],
    }
    disk = ctl.store.engine_disk_reads()
    if disk is not None:  # where engines read pages only on disk themselves (client/disk_share.py)
        header["disk"] = disk
    return msgpack.packb(header), [c.fd for c in shared.components]
