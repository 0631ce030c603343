"""The ``hicache serve`` process: server loop, sessions, lanes, metrics, sharing's sidecar half."""
