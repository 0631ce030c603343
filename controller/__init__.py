"""The controller: host pool, LMDB tier, page index, transfers and the sidecar server.

The names below load their modules on first use, so that importing one part (say the
engine's ``SidecarController``) does not load the others.
"""

from __future__ import annotations

from hicache.lazy_exports import lazy_getattr

_EXPORTS = {
    "LocalController": "hicache.controller.store.local",
    "ControllerLayoutMismatch": "hicache.controller.store.local",
    "EngineSession": "hicache.controller.store.session",
    "ControllerConfig": "hicache.controller.config",
    "DiskWritePolicy": "hicache.controller.config",
    "HostPinning": "hicache.controller.config",
    "FaultPlan": "hicache.controller.store.faults",
    "SidecarController": "hicache.controller.client.sidecar_client",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
