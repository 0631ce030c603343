"""Fault injection for tests: arm a failure, and the next matching operation meets it.

The controller holds ``faults = None`` in production; every hook is one attribute test
(``if self.faults is not None``) on the operation's path, and nothing more.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class FaultPlan:
    """Counts of failures to inject, each consumed by the next matching operation.

    * ``pin``: ``pin`` raises ControllerError;
    * ``disk_read``: a disk → host read fails as an LMDB error would;
    * ``disk_write``: a writer transaction fails as an LMDB disk error would;
    * ``copy_to_host`` / ``copy_to_device``: a device ↔ host copy raises;
    * ``copy_at_layer``: the copy of the layer group holding this model layer, in the next
      layer-wise load, raises (-1: none);
    * ``evict_before_load``: ``load`` finds the last page it was asked for gone from
      every tier, as if its pin had lapsed and the page had been evicted meanwhile;
    * ``evict_host_before_load``: the same page loses only its host copy (its disk copy,
      if any, stays: the load reads it again).

    ``disk_read_delay_s`` slows every disk read (to provoke load timeouts).
    """

    pin: int = 0
    disk_read: int = 0
    disk_write: int = 0
    copy_to_host: int = 0
    copy_to_device: int = 0
    copy_at_layer: int = -1
    evict_before_load: int = 0
    evict_host_before_load: int = 0
    disk_read_delay_s: float = 0.0
    fired: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def take_layer(self, first: int, end: int) -> bool:
        """True (and disarmed) when ``copy_at_layer`` lies in model layers ``[first, end)``."""
        with self._lock:
            if not first <= self.copy_at_layer < end:
                return False
            self.copy_at_layer = -1
            self.fired["copy_at_layer"] = self.fired.get("copy_at_layer", 0) + 1
            return True

    def take(self, what: str) -> bool:
        """True (and one fewer armed) when a ``what`` failure is armed."""
        with self._lock:
            left = getattr(self, what)
            if left <= 0:
                return False
            setattr(self, what, left - 1)
            self.fired[what] = self.fired.get(what, 0) + 1
            return True
