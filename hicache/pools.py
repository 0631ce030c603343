"""Device pools: KV for full-attention and sliding-window layers, and Mamba state slots.

Every pool is also its own page-granular allocator: a free list of pages with O(1)
alloc/free per page, and a state byte per page so that a double free, or a free of a page
that was never handed out, raises instead of corrupting the pool.

Token slot ``s`` lives in page ``s // page_size``; a page's slots are contiguous. The KV
storage of a pool is one tensor ``[2, layers, slots, kv_heads, head_dim]`` (K then V), so
``k_layer(i)`` / ``v_layer(i)`` are ``[slots, heads, head_dim]`` views and the whole pool
can be registered with a sidecar as one buffer.
"""

from __future__ import annotations

import contextlib
import math
import secrets
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np
import torch

from hicache.config import CacheConfig
from hicache.layout import LayerKind, ModelLayout, dtype_name
from hicache.types import PoolExhaustedError, SlotStateError

_FREE = 0
_ALLOCATED = 1

# Check on every free that a caller claiming distinct pages really has them (a sort per
# call). Off by default (the hot path of eviction); the tests turn it on
# (tests/conftest.py sets DEBUG_CHECKS = True).
DEBUG_CHECKS = False

# A shared pool segment ends with this many random bytes, right after the tensor. The
# engine sends them at register; the sidecar maps a segment only if its bytes there are
# the same, so a peer that cannot read the segment (over TCP, from another machine)
# cannot have the sidecar map it, nor any other program's shared memory.
SEGMENT_KEY_BYTES = 16


@dataclass(frozen=True)
class SharedTensorInfo:
    """How another process maps a pool tensor that lives in named shared memory."""

    shm_name: str
    dtype: str
    shape: tuple[int, ...]
    key: bytes  # the segment's last SEGMENT_KEY_BYTES bytes, which only its readers know

    def to_dict(self) -> dict:
        return {
            "shm_name": self.shm_name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "key": self.key,
        }


class _TensorFactory:
    """Allocates pool tensors on a device, or on the CPU in named shared memory."""

    def __init__(self, device: str, shared: bool) -> None:
        self.device = torch.device(device)
        self.shared = shared and self.device.type == "cpu"
        self.segments: list[shared_memory.SharedMemory] = []

    def zeros(
        self, shape: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[torch.Tensor, SharedTensorInfo | None]:
        if not self.shared:
            return torch.zeros(shape, dtype=dtype, device=self.device), None
        nbytes = max(1, math.prod(shape) * dtype.itemsize)
        key = secrets.token_bytes(SEGMENT_KEY_BYTES)
        seg = shared_memory.SharedMemory(create=True, size=nbytes + SEGMENT_KEY_BYTES)
        self.segments.append(seg)
        flat = torch.frombuffer(seg.buf, dtype=torch.uint8, count=nbytes)
        flat.zero_()
        seg.buf[nbytes : nbytes + SEGMENT_KEY_BYTES] = key
        tensor = flat.view(dtype).view(shape)
        return tensor, SharedTensorInfo(seg.name, dtype_name(dtype), tuple(shape), key)

    def close(self) -> None:
        """Remove every segment's name from /dev/shm (its memory goes with the last
        mapping), then unmap it where no tensor still views it."""
        for seg in self.segments:
            with contextlib.suppress(FileNotFoundError):
                seg.unlink()
            with contextlib.suppress(BufferError):
                seg.close()
        self.segments.clear()


class PageAllocator:
    """A free list of ``num_pages`` pages of ``page_size`` slots each."""

    def __init__(self, num_pages: int, page_size: int, name: str) -> None:
        self.name = name
        self.page_size = page_size
        self.num_pages = num_pages
        self._state = np.zeros(num_pages, dtype=np.uint8)
        # A stack of free page ids: pops come from the end, pushes go to the end.
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int64)
        self._top = num_pages
        self._ones = b""  # int64 ones, as many as the longest whole-page check needed

    # -- queries -------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Total slots in the pool."""
        return self.num_pages * self.page_size

    def available(self) -> int:
        """Free slots (tokens for KV pools, states for the Mamba pool)."""
        return self._top * self.page_size

    def available_pages(self) -> int:
        return self._top

    def allocated_pages(self) -> np.ndarray:
        """Ids of all pages currently handed out (for leak checks)."""
        return np.flatnonzero(self._state == _ALLOCATED)

    def is_allocated(self, pages: np.ndarray) -> bool:
        return bool(np.all(self._state[pages] == _ALLOCATED))

    # -- alloc / free --------------------------------------------------------------------

    def alloc_pages(self, n: int) -> np.ndarray:
        """Hand out ``n`` pages; raises PoolExhaustedError (changing nothing) if too few."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self._top:
            raise PoolExhaustedError(
                f"{self.name} pool: {n} pages requested, {self._top} free of {self.num_pages}"
            )
        self._top -= n
        # The stack's top run, in the order it was freed (a fresh pool: ascending): a
        # request's pages then run consecutively, which lets a copy of many of them go
        # out as a few large DMAs.
        pages = self._free[self._top : self._top + n][::-1].copy()
        self._state[pages] = _ALLOCATED
        return pages

    def free_pages(self, pages: np.ndarray, distinct: bool = False) -> None:
        """Return pages to the pool; raises SlotStateError (changing nothing) on a page out
        of range or not allocated. ``distinct=True`` says the caller knows its pages are
        distinct and were handed out by this pool (a tree node's own pages), which skips
        the sort that checks for a page given twice and the range check, unless
        :data:`DEBUG_CHECKS` is on (as in the tests); a page not allocated still raises."""
        if type(pages) is not np.ndarray or pages.dtype != np.int64 or pages.ndim != 1:
            pages = np.asarray(pages, dtype=np.int64).reshape(-1)
        n = pages.size
        if n == 0:
            return
        state = self._state
        if n == 1:  # the common single-page case: plain integers, no array operations
            page = int(pages[0])
            if not 0 <= page < self.num_pages:
                raise SlotStateError(f"{self.name} pool: page id out of range in free")
            if state[page] != _ALLOCATED:
                raise SlotStateError(f"{self.name} pool: free of pages not allocated: [{page}]")
            state[page] = _FREE
            self._free[self._top] = page
            self._top += 1
            return
        checked = DEBUG_CHECKS or not distinct
        # Distinct pages come from a tree node, which got them from this pool: in range.
        if checked and (pages.min() < 0 or pages.max() >= self.num_pages):
            raise SlotStateError(f"{self.name} pool: page id out of range in free")
        held = state[pages]
        if not held.all():  # _ALLOCATED is 1, _FREE 0
            bad = pages[held != _ALLOCATED][:8].tolist()
            raise SlotStateError(f"{self.name} pool: free of pages not allocated: {bad}")
        if checked and np.unique(pages).size != n:
            raise SlotStateError(f"{self.name} pool: the same page freed twice in one call")
        state[pages] = _FREE
        self._free[self._top : self._top + n] = pages[::-1]
        self._top += n

    def take_pages(self, pages: np.ndarray) -> None:
        """Allocate exactly ``pages`` (all free) again: a caller that had to free pages
        it must still keep (a copy may yet touch them) takes them back at once. O(pool)."""
        pages = np.asarray(pages, dtype=np.int64).reshape(-1)
        if pages.size == 0:
            return
        if np.any(self._state[pages] != _FREE) or np.unique(pages).size != pages.size:
            raise SlotStateError(f"{self.name} pool: take of pages that are not all free")
        free = self._free[: self._top]
        keep = free[~np.isin(free, pages)]
        self._free[: keep.size] = keep
        self._top = keep.size
        self._state[pages] = _ALLOCATED

    # -- slots ---------------------------------------------------------------------------

    def pages_to_slots(self, pages: np.ndarray) -> np.ndarray:
        """All slots of the given pages, page by page."""
        pages = np.asarray(pages, dtype=np.int64)
        if self.page_size == 1:
            return pages.copy()
        return (pages[:, None] * self.page_size + np.arange(self.page_size)).reshape(-1)

    def alloc_slots(self, num_tokens: int) -> np.ndarray:
        """Slots for ``num_tokens`` tokens, in whole pages (the last page may be part-used).

        Returns exactly ``num_tokens`` slots; the unused rest of the last page stays with
        the caller until it frees that page.
        """
        pages = self.alloc_pages(-(-num_tokens // self.page_size))
        return self.pages_to_slots(pages)[:num_tokens]

    def slots_to_pages(self, slots: np.ndarray) -> np.ndarray:
        """The distinct pages touched by ``slots``, in first-seen order."""
        slots = np.asarray(slots, dtype=np.int64)
        if self.page_size == 1:
            return slots.copy()
        pages = slots // self.page_size
        _, first = np.unique(pages, return_index=True)
        return pages[np.sort(first)]

    def free_slots(self, slots: np.ndarray) -> None:
        """Free every page that ``slots`` touch (a part-used page is freed whole)."""
        self.free_pages(self.slots_to_pages(slots))

    def check_whole_pages(self, slots: np.ndarray) -> bool:
        """True when ``slots`` are whole pages, each page's slots in order."""
        slots = np.asarray(slots, dtype=np.int64)
        ps = self.page_size
        if slots.size % ps:
            return False
        if ps == 1 or slots.size == 0:
            return True
        # Each page's first slot is page-aligned and every step inside a page is +1. In
        # 1-D passes and one memcmp: a (pages, page_size) comparison runs NumPy's inner
        # loop once per page (~7 µs for 64 pages of 16 here, against ~3 µs).
        if np.count_nonzero(slots[::ps] % ps):
            return False
        steps = slots[1:] - slots[:-1]
        steps[ps - 1 :: ps] = 1  # the steps across page boundaries may be anything
        if len(self._ones) < steps.nbytes:
            self._ones = np.ones(max(steps.size, 2 * len(self._ones) // 8), np.int64).tobytes()
        return self._ones.startswith(steps)  # every step +1


class KVPool(PageAllocator):
    """K and V of one layer kind (full attention or sliding window), all its layers."""

    def __init__(
        self,
        kind: LayerKind,
        layout: ModelLayout,
        num_slots: int,
        page_size: int,
        factory: _TensorFactory,
    ) -> None:
        super().__init__(num_slots // page_size, page_size, kind.value)
        self.kind = kind
        self.layers = layout.layers_of(kind)
        shape = (2, len(self.layers), self.capacity, layout.num_kv_heads, layout.head_dim)
        self.buffer, self.shared_info = factory.zeros(shape, layout.dtype)

    def k_layer(self, i: int) -> torch.Tensor:
        """K of the i-th layer of this kind, ``[slots, heads, head_dim]``."""
        return self.buffer[0, i]

    def v_layer(self, i: int) -> torch.Tensor:
        return self.buffer[1, i]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


class MambaPool(PageAllocator):
    """Conv and SSM state slots of all Mamba layers (a page is one state slot).

    With speculative decoding configured, ``spec_conv`` holds every draft step's conv
    window (a :class:`~hicache.kernels.ConvWindowBuffer`, de-duplicated for linear drafts
    on CUDA) and ``spec_ssm`` every draft step's SSM state, ``[layers, spec_slots, D, *S]``:
    the sources of the masked state scatters that commit accepted steps.
    """

    def __init__(
        self,
        layout: ModelLayout,
        num_slots: int,
        factory: _TensorFactory,
        config: CacheConfig | None = None,
    ) -> None:
        super().__init__(num_slots, 1, "mamba")
        n_layers = len(layout.mamba_layers)
        self.conv, conv_info = factory.zeros(
            (n_layers, num_slots, *layout.conv_state_shape), layout.state_dtype
        )
        self.ssm, ssm_info = factory.zeros(
            (n_layers, num_slots, *layout.ssm_state_shape), layout.state_dtype
        )
        self.shared_info = (conv_info, ssm_info) if conv_info is not None else None
        self.spec_conv = None
        self.spec_ssm = None
        draft = config.speculative_draft_tokens if config is not None else 0
        if draft:
            from hicache.kernels.spec_buffers import ConvWindowBuffer

            spec_slots = config.speculative_slots or num_slots
            self.spec_conv = ConvWindowBuffer.allocate(
                n_layers,
                spec_slots,
                draft,
                layout.conv_dim,
                layout.conv_kernel,
                layout.state_dtype,
                factory.device,
                draft_topk=config.speculative_topk,
            )
            self.spec_ssm = torch.zeros(
                (n_layers, spec_slots, draft, *layout.ssm_state_shape),
                dtype=layout.state_dtype,
                device=factory.device,
            )

    def alloc_state(self) -> int:
        """One state slot; raises PoolExhaustedError when none is free."""
        return int(self.alloc_pages(1)[0])

    def free_state(self, slot: int) -> None:
        self.free_pages(np.array([slot], dtype=np.int64))

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        """Copy the conv and SSM state of ``src_slot`` into ``dst_slot`` (all layers)."""
        self.conv[:, dst_slot].copy_(self.conv[:, src_slot])
        self.ssm[:, dst_slot].copy_(self.ssm[:, src_slot])

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer the pool allocated (physical storage, not logical views)."""
        total = sum(t.untyped_storage().nbytes() for t in (self.conv, self.ssm))
        if self.spec_conv is not None:
            total += self.spec_conv.nbytes + self.spec_ssm.untyped_storage().nbytes()
        return total


class DevicePools:
    """The engine's device memory for the cache: FULL KV, SWA KV and Mamba state pools."""

    def __init__(
        self,
        layout: ModelLayout,
        config: CacheConfig,
        full: KVPool,
        swa: KVPool | None,
        mamba: MambaPool | None,
        factory: _TensorFactory,
    ) -> None:
        self.layout = layout
        self.config = config
        self.full = full
        self.swa = swa
        self.mamba = mamba
        self._factory = factory
        self.full_to_swa = np.full(full.num_pages, -1, dtype=np.int64)

    @classmethod
    def allocate(cls, layout: ModelLayout, config: CacheConfig) -> DevicePools:
        """Allocate every pool the layout needs on ``config.device``.

        With ``config.shared_memory`` on a CPU device, the tensors live in named shared
        memory so that a sidecar process can map them (see :meth:`shared_tensors`).
        """
        config.validate(layout)
        return cls._build(layout, config)

    @classmethod
    def allocate_pages(
        cls,
        layout: ModelLayout,
        page_size: int,
        pages: int,
        device: str = "cpu",
        shared_memory: bool = False,
    ) -> DevicePools:
        """Pages addressed by number, not a cache's pools (a staging area's): ``pages``
        pages of ``page_size`` slots in each KV pool the layout has, and ``pages`` state
        slots where it has Mamba layers. No rule of a cache applies (a window, a request's
        Mamba state); ``shared_memory`` as in :meth:`allocate`."""
        config = CacheConfig(
            page_size=page_size,
            full_slots=pages * page_size,
            mamba_slots=pages if layout.has_mamba else 0,
            device=device,
            shared_memory=shared_memory,
        )
        return cls._build(layout, config)

    @classmethod
    def _build(cls, layout: ModelLayout, config: CacheConfig) -> DevicePools:
        factory = _TensorFactory(config.device, config.shared_memory)
        ps = config.page_size
        try:
            full = KVPool(LayerKind.FULL, layout, config.full_slots, ps, factory)
            swa = (
                KVPool(LayerKind.SWA, layout, config.swa_slots, ps, factory)
                if layout.has_swa
                else None
            )
            mamba = (
                MambaPool(layout, config.mamba_slots, factory, config) if layout.has_mamba else None
            )
        except BaseException:  # a later pool did not fit: the earlier ones' segments go
            factory.close()
            raise
        return cls(layout, config, full, swa, mamba, factory)

    # -- FULL pages and the SWA pages that go with them ---------------------------------
    #
    # Every FULL page may have one SWA page: ``full_to_swa[p]`` (-1 when it has none, i.e.
    # the sliding-window KV of those tokens was never written or has been freed). So an
    # engine and the tree address SWA KV through FULL slots and never keep a second index.

    def alloc_kv_pages(self, n: int) -> np.ndarray:
        """``n`` FULL pages, each with a fresh SWA page when the layout has SWA layers.

        All or nothing: raises PoolExhaustedError with both pools unchanged.
        """
        pages = self.full.alloc_pages(n)
        if self.swa is not None:
            try:
                self.full_to_swa[pages] = self.swa.alloc_pages(n)
            except Exception:
                self.full.free_pages(pages)
                raise
        return pages

    def alloc_swa_for(self, full_pages: np.ndarray) -> None:
        """Give each of ``full_pages`` (which must have none) a fresh SWA page."""
        full_pages = np.asarray(full_pages, dtype=np.int64)
        if self.swa is None or full_pages.size == 0:
            return
        if np.any(self.full_to_swa[full_pages] >= 0):
            raise SlotStateError("alloc_swa_for: a FULL page already has an SWA page")
        self.full_to_swa[full_pages] = self.swa.alloc_pages(full_pages.size)

    def free_swa_of(self, full_pages: np.ndarray, distinct: bool = False) -> int:
        """Free the SWA pages of ``full_pages`` (those that have one); returns slots freed.
        ``distinct``: as in :meth:`PageAllocator.free_pages` (distinct FULL pages map to
        distinct SWA pages)."""
        if self.swa is None:
            return 0
        full_pages = np.asarray(full_pages, dtype=np.int64)
        swa = self.full_to_swa[full_pages]
        swa = swa[swa >= 0]
        self.swa.free_pages(swa, distinct)
        self.full_to_swa[full_pages] = -1
        return int(swa.size) * self.swa.page_size

    def free_kv_pages(self, full_pages: np.ndarray, distinct: bool = False) -> None:
        """Free FULL pages together with their SWA pages (``distinct``: as in
        :meth:`PageAllocator.free_pages`)."""
        self.free_swa_of(full_pages, distinct)
        self.full.free_pages(full_pages, distinct)

    def swa_slots_of(self, full_slots: np.ndarray) -> np.ndarray:
        """The SWA slot of each FULL slot (-1 where its page has no SWA page)."""
        full_slots = np.asarray(full_slots, dtype=np.int64)
        ps = self.full.page_size
        swa_pages = self.full_to_swa[full_slots // ps]
        return np.where(swa_pages >= 0, swa_pages * ps + full_slots % ps, -1)

    def all(self) -> list[PageAllocator]:
        return [p for p in (self.full, self.swa, self.mamba) if p is not None]

    def free_counts(self) -> dict[str, int]:
        """Free slots per pool, keyed by pool name: the numbers a leak check compares."""
        return {p.name: p.available() for p in self.all()}

    def shared_tensors(self) -> dict[str, dict]:
        """Names, dtypes and shapes of the shared-memory pool tensors (CPU sharing only)."""
        out: dict[str, dict] = {}
        if self.full.shared_info is not None:
            out["full"] = self.full.shared_info.to_dict()
        if self.swa is not None and self.swa.shared_info is not None:
            out["swa"] = self.swa.shared_info.to_dict()
        if self.mamba is not None and self.mamba.shared_info is not None:
            out["mamba_conv"] = self.mamba.shared_info[0].to_dict()
            out["mamba_ssm"] = self.mamba.shared_info[1].to_dict()
        return out

    def close(self) -> None:
        """Release shared-memory segments (the tensors must not be used afterwards)."""
        self._factory.close()
