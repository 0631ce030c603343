"""The engine process's side of the sidecar (no store, no LMDB, no Redis).

What an engine or an integration needs: the client (a :class:`hicache.CacheController`)
and its configuration and errors, the admin client, and the engine halves of sharing
memory with the sidecar (``export_pools`` describes an engine's pools; ``send_fds`` hands
memory descriptors over the descriptor socket at ``fd_socket_path``). The names load their
modules on first use, so that an engine pays only for what it uses.
"""

from __future__ import annotations

from hicache.lazy_exports import lazy_getattr

_EXPORTS = {
    "SidecarController": "hicache.controller.client.sidecar_client",
    "SidecarClientConfig": "hicache.controller.client.channel",
    "SidecarUnavailable": "hicache.controller.client.channel",
    "RemoteError": "hicache.controller.client.channel",
    "AdminClient": "hicache.controller.client.admin",
    "StagingArea": "hicache.controller.client.staging",
    "PendingBegin": "hicache.controller.client.engine_copies",
    "PendingPin": "hicache.controller.client.engine_copies",
    "StoreReservation": "hicache.controller.client.engine_copies",
    "export_pools": "hicache.controller.client.device_share",
    "fd_socket_path": "hicache.controller.client.fd_pass",
    "send_fds": "hicache.controller.client.fd_pass",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return __all__
