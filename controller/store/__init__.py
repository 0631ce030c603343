"""The page store, in the sidecar or in-process: index, pins, fills, host pool, copies."""
