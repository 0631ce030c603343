"""The layer-wise load of engine blocks (:meth:`~hicache.integrations.engine_blocks.
EngineBlocks.start_layer_load`): each layer's copy marked ready as it is issued (GPU) or
done (CPU), waited for layer by layer, and the pin released once every copy has ended."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from hicache.controller.client import SidecarController

log = logging.getLogger(__name__)


class BlockLayerLoad:
    """A layer-wise load of engine blocks (:meth:`EngineBlocks.start_layer_load`):
    :meth:`wait` for a layer, :meth:`finish` once the engine no longer needs any."""

    def __init__(
        self, client: SidecarController, pin, layers: list[str], device: torch.device | None = None
    ) -> None:
        self._client = client
        self._device = device
        self._pin = pin
        self._t0 = time.perf_counter()
        self._ready = {name: threading.Event() for name in layers}
        self._events: dict[str, object] = {}
        self._ended = threading.Event()
        self.ok = pin is not None
        self._finished: bool | None = None
        if pin is None:
            for ev in self._ready.values():
                ev.set()
            self._ended.set()

    def run(self, work: list, copy: Callable) -> None:
        """Copy (on a CPU) or issue (on a GPU) each layer in order, marking it ready."""
        try:
            for name, blocks, pages in work:
                if self.ok:
                    try:
                        self._events[name] = copy(name, blocks, pages)
                    except Exception as exc:
                        log.error("layer %s of a load failed: %s", name, exc)
                        self.ok = False
                self._ready[name].set()
        finally:
            for ev in self._ready.values():
                ev.set()
            self._ended.set()

    def wait(self, layer: str) -> bool:
        """Wait until ``layer``'s blocks may be read by the caller's next work (on a GPU:
        its current stream waits for the layer's copy); False when the load failed (a
        layer this load does not know is ready at once)."""
        ready = self._ready.get(layer)
        if ready is None:
            return self.ok
        ready.wait()
        event = self._events.get(layer)
        if event is not None and self.ok:
            event.wait(torch.cuda.current_stream(self._device))
        return self.ok

    def finish(self) -> bool:
        """Wait for every copy, unpin (telling the sidecar it was served), and say whether
        every byte arrived; a second call returns the first's answer."""
        if self._finished is None:
            self._ended.wait()
            try:
                wait_all(list(self._events.values()))
            except Exception as exc:
                log.error("a layer-wise copy failed: %s", exc)
                self.ok = False
            if self._pin is not None:
                loaded = time.perf_counter() - self._t0 if self.ok else None
                self._client.unpin(self._pin, loaded_s=loaded)
            self._finished = self.ok
        return self._finished


def wait_all(events: list, quiet: bool = False) -> None:
    """Wait for copies started; ``quiet``: one that failed is logged, not raised."""
    for event in events:
        if event is None:
            continue
        try:
            event.synchronize()
        except Exception as exc:
            if not quiet:
                raise
            log.error("a copy to or from the shared host pages failed: %s", exc)
