"""The engine process's side of the sidecar (no store, no LMDB, no Redis).

The client, its channel, the engine halves of host/device/fd sharing, the staging area and
its quarantine that the vLLM and SGLang integrations share.
"""

from hicache.controller.client.sidecar_client import SidecarController

__all__ = ["SidecarController"]
