"""The controller: host pool, LMDB tier, page index, transfers and the sidecar server."""
