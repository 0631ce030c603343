"""The copy path between SGLang's host pools and the sidecar: shared staging pages.

The sidecar copies pages between its tiers and an engine's registered "device" pools. For
SGLang those are staging pools the backend allocates in named shared memory (hicache's own
``DevicePools``): ``batch_set`` copies SGLang's host pages in and asks for a backup of the
staging pages; ``batch_get`` asks for a load into staging pages and copies them out into
SGLang's host pool. Each direction has its own half of the staging pages and its own lock,
so SGLang's prefetch and backup threads never wait on each other.

A transfer the client gave up on (no reply by its deadline) may still run in the sidecar
and touch its staging pages; that half is then held back (every call on it is a miss)
until the transfer is settled, so no late copy mixes with a newer call's pages.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from hicache.config import CacheConfig
from hicache.integrations.sglang_pages import UNIT_DTYPE
from hicache.layout import ModelLayout
from hicache.pools import DevicePools
from hicache.types import ComponentType


def flat_units(page: torch.Tensor) -> torch.Tensor:
    """A flat data page as 2-byte units (a view when it is contiguous)."""
    return page.contiguous().view(torch.uint8).view(UNIT_DTYPE)


class StagingHalf:
    """One direction's staging pages: FULL/SWA pages ``first .. first+count`` and the
    Mamba slots of the same numbers."""

    def __init__(self, first: int, count: int) -> None:
        self.first = first
        self.count = count
        self.lock = threading.Lock()
        self.unsettled: list[Any] = []  # transfers given up on that may still touch it

    def usable(self) -> bool:
        """True when no abandoned transfer can still touch these pages."""
        self.unsettled = [t for t in self.unsettled if not t.done()]
        return not self.unsettled


class Staging:
    """Staging pools shaped by the sidecar layout, split in a get half and a set half."""

    def __init__(self, layout: ModelLayout, page_size: int, pages_per_direction: int) -> None:
        total = 2 * pages_per_direction
        self.page_size = page_size
        self.config = CacheConfig(
            page_size=page_size,
            full_slots=total * page_size,
            swa_slots=total * page_size,
            mamba_slots=max(total, 2),
            sliding_window=page_size if layout.has_swa else None,
            shared_memory=True,
        )
        self.pools = DevicePools.allocate(layout, self.config)
        self.get_half = StagingHalf(0, pages_per_direction)
        self.set_half = StagingHalf(pages_per_direction, pages_per_direction)

    def _kv_view(self, component: ComponentType, page: int) -> torch.Tensor:
        pool = self.pools.full if component is ComponentType.FULL else self.pools.swa
        ps = self.page_size
        return pool.buffer[:, :, page * ps : (page + 1) * ps]

    def write(self, component: ComponentType, page: int, data_page: torch.Tensor) -> None:
        """Copy one SGLang flat data page into staging page (or Mamba slot) ``page``."""
        units = flat_units(data_page)
        if component is ComponentType.MAMBA:
            conv, ssm = self.pools.mamba.conv[:, page], self.pools.mamba.ssm[:, page]
            n = conv.numel()
            conv.copy_(units[:n].view(conv.shape))
            ssm.copy_(units[n:].view(ssm.shape))
            return
        view = self._kv_view(component, page)
        view.copy_(units.view(view.shape))

    def read(self, component: ComponentType, page: int) -> torch.Tensor:
        """The bytes of staging page (or Mamba slot) ``page`` as a flat uint8 tensor."""
        if component is ComponentType.MAMBA:
            mamba = self.pools.mamba
            units = torch.cat([mamba.conv[:, page].flatten(), mamba.ssm[:, page].flatten()])
        else:
            units = self._kv_view(component, page).flatten()
        return units.view(torch.uint8)

    def close(self) -> None:
        self.pools.close()
