"""The host tier's memory: page-granular, page-first, pinned when CUDA is available.

One page of one component is one contiguous run of bytes that covers every layer of that
component, so a page moves to and from LMDB as a single value, and a batch of pages moves
to and from the device in one kernel launch. Typed views match
:mod:`hicache.kernels.reference`:

* FULL / SWA: ``kv(c)`` is ``[pages, 2, layers, page_size, heads, head_dim]`` (K then V);
* MAMBA: a page is the conv state of every Mamba layer, then the SSM state of every Mamba
  layer; ``conv()`` is ``[pages, layers, conv_dim, K-1]`` and ``ssm()`` is
  ``[pages, layers, *ssm_state_shape]``, strided views into the same bytes.

Sizing: component ``c`` gets ``n_c = floor(B * w_c / sum_d(w_d * page_bytes_d))`` pages
for a budget of ``B`` bytes and weights ``w`` (see :class:`ControllerConfig`), so the
weights are page-count ratios and the payload bytes add up to at most ``B``. Each page
also carries a frame of 128 bytes (its LMDB header and alignment padding), outside the
budget; ``resident_bytes`` counts it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import mmap
import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from hicache.controller.config import ControllerConfig, HostPinning
from hicache.controller.store.page_codec import HEADER_BYTES
from hicache.layout import LayerKind, ModelLayout
from hicache.types import ComponentType, ConfigError, SlotStateError

log = logging.getLogger(__name__)

# Bytes in front of each host page: its LMDB header sits at the end of this room.
FRAME_BYTES = 128


def _allocate_bytes(
    num_pages: int, page_bytes: int, pinning: HostPinning, prefault: bool
) -> torch.Tensor:
    """``[num_pages, page_bytes]`` uint8, pinned as the policy asks (AUTO falls back);
    faulted in with ``prefault`` (pinned memory is anyway)."""
    if _wants_pin(pinning):
        try:
            return torch.empty((num_pages, page_bytes), dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:
            _pin_failed(pinning, num_pages * page_bytes, exc)
    out = torch.empty((num_pages, page_bytes), dtype=torch.uint8)
    if prefault and out.numel():
        populate(out.data_ptr(), out.numel())
    return out


def _wants_pin(pinning: HostPinning) -> bool:
    return pinning is HostPinning.PINNED or (
        pinning is HostPinning.AUTO and torch.cuda.is_available()
    )


def _pin_failed(pinning: HostPinning, nbytes: int, exc: Exception) -> None:
    """Raise for a pool that must be pinned; warn for one that may fall back."""
    if pinning is HostPinning.PINNED:
        raise ConfigError(
            f"could not pin {nbytes} bytes of host memory ({exc}); "
            "raise the memlock limit (ulimit -l) or set host_pinning='auto'"
        ) from exc
    log.warning("host pool: pinning failed (%s); using pageable memory", exc)


class SharedPages:
    """Host pages in a ``memfd`` that the sidecar's engines map to copy from themselves
    (controller/client/host_share.py): the descriptor, its mapping and, on CUDA, the
    registration that makes it pinned. Released with the pool (the mapping goes once no
    tensor uses it)."""

    def __init__(
        self,
        name: str,
        num_pages: int,
        page_bytes: int,
        pinning: HostPinning,
        prefault: bool = False,
    ):
        nbytes = max(num_pages * page_bytes, 1)
        self.fd = os.memfd_create(f"hicache-host-{name}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)
            mapping = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(self.fd)
            raise
        # Through NumPy, whose array holds an export of the mapping while a tensor lives.
        raw = np.frombuffer(mapping, dtype=np.uint8, count=num_pages * page_bytes)
        self.buffer = torch.from_numpy(raw).view(num_pages, page_bytes)
        registered = None  # the address CUDA page-locked, unregistered at release
        pin = num_pages and _wants_pin(pinning)
        if pin or (num_pages and prefault):
            populate(self.buffer.data_ptr(), nbytes)  # else the registration does, alone
        if pin:
            rc = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), nbytes, 0)
            if int(rc) == 0:
                registered = self.buffer.data_ptr()
            else:
                _pin_failed(pinning, nbytes, RuntimeError(f"cudaHostRegister returned {rc}"))
        self._release = weakref.finalize(self, _release_shared, self.fd, registered)


MADV_POPULATE_WRITE = 23  # Linux 5.14: fault a range in, writable, without touching it
POPULATE_THREADS = 8
POPULATE_CHUNK_BYTES = 256 << 20


def populate(address: int, nbytes: int) -> None:
    """Fault the ``nbytes`` of shared memory at ``address`` in, from several threads at
    once: the kernel zeroes each new page in the faulting thread, about a second per few
    GiB from one thread, which a registration with CUDA would otherwise spend alone. Nothing
    when the kernel cannot (before Linux 5.14): the pages then fault in at registration."""
    aligned = -(-address // mmap.PAGESIZE) * mmap.PAGESIZE  # madvise takes whole pages
    address, nbytes = aligned, nbytes - (aligned - address)
    if nbytes <= 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)  # ctypes calls run without the GIL
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

    def chunk(start: int) -> int:
        n = min(POPULATE_CHUNK_BYTES, nbytes - start)
        return libc.madvise(address + start, n, MADV_POPULATE_WRITE)

    starts = range(0, nbytes, POPULATE_CHUNK_BYTES)
    if not starts or chunk(0) != 0:
        return  # an older kernel: no populate
    with ThreadPoolExecutor(min(POPULATE_THREADS, os.cpu_count() or 1)) as pool:
        list(pool.map(chunk, starts[1:]))


def _release_shared(fd: int, registered_ptr: int | None) -> None:
    if registered_ptr is not None:
        with contextlib.suppress(Exception):
            torch.cuda.cudart().cudaHostUnregister(registered_ptr)
    with contextlib.suppress(OSError):
        os.close(fd)


class HostComponentPool:
    """The host pages of one component, with an O(1) free list.

    Each page is a *frame*: ``FRAME_BYTES`` in front of the payload hold the page's LMDB
    header (written by the disk writer), so header and payload go to LMDB as one value
    straight from host memory. Frames are padded to a multiple of ``FRAME_BYTES``, so
    every payload starts 128-byte aligned; typed views skip the frames.
    """

    def __init__(
        self,
        component: ComponentType,
        layout: ModelLayout,
        page_size: int,
        num_pages: int,
        pinning: HostPinning,
        shared: bool = False,
        buffer: torch.Tensor | None = None,
        prefault: bool = False,
    ) -> None:
        """``shared``: the pages live in a memfd (``self.shared``) that engines may map;
        ``buffer``: pages another process allocated, mapped here (``[num_pages,
        row_bytes]`` uint8), instead of new memory; ``prefault``: new memory faulted in
        at once (:func:`populate`)."""
        self.component = component
        self.page_bytes = layout.page_bytes(component, page_size)
        self.num_pages = num_pages
        self.row_bytes = row_bytes(self.page_bytes)
        self.shared: SharedPages | None = None
        if buffer is not None:
            if tuple(buffer.shape) != (num_pages, self.row_bytes) or buffer.dtype != torch.uint8:
                raise ConfigError(
                    f"host {component.name} pages: a buffer of {tuple(buffer.shape)} "
                    f"{buffer.dtype}, not ({num_pages}, {self.row_bytes}) uint8"
                )
            self.buffer = buffer
        elif shared:
            self.shared = SharedPages(
                component.name.lower(), num_pages, self.row_bytes, pinning, prefault
            )
            self.buffer = self.shared.buffer
        else:
            self.buffer = _allocate_bytes(num_pages, self.row_bytes, pinning, prefault)
        self.pinned = bool(self.buffer.is_pinned()) if num_pages else False
        # The same bytes as numpy rows: LMDB reads and writes go through these.
        self.rows: np.ndarray = self.buffer.numpy()
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._in_use = np.zeros(num_pages, dtype=bool)
        self._make_views(layout, page_size)

    def _make_views(self, layout: ModelLayout, page_size: int) -> None:
        n = self.num_pages
        if self.component is ComponentType.MAMBA:
            item = layout.state_dtype.itemsize
            typed = self.buffer.view(layout.state_dtype)
            per_page, start = self.row_bytes // item, FRAME_BYTES // item
            n_layers = len(layout.mamba_layers)
            conv_shape = layout.conv_state_shape
            conv_elems = math.prod(conv_shape)
            ssm_shape = layout.ssm_state_shape
            ssm_elems = math.prod(ssm_shape)
            self.conv_view = typed.as_strided(
                (n, n_layers, *conv_shape),
                (per_page, conv_elems, *_contiguous_strides(conv_shape)),
                storage_offset=start,
            )
            self.ssm_view = typed.as_strided(
                (n, n_layers, *ssm_shape),
                (per_page, ssm_elems, *_contiguous_strides(ssm_shape)),
                storage_offset=start + n_layers * conv_elems,
            )
            self.kv_view = None
        else:
            kind = LayerKind.FULL if self.component is ComponentType.FULL else LayerKind.SWA
            shape = (2, len(layout.layers_of(kind)), page_size, layout.num_kv_heads)
            shape = (*shape, layout.head_dim)
            item = layout.dtype.itemsize
            self.kv_view = self.buffer.view(layout.dtype).as_strided(
                (n, *shape),
                (self.row_bytes // item, *_contiguous_strides(shape)),
                storage_offset=FRAME_BYTES // item,
            )
            self.conv_view = self.ssm_view = None

    # -- allocation ----------------------------------------------------------------------

    def alloc(self) -> int | None:
        """A free page id, or None when every page is in use."""
        if not self._free:
            return None
        page = self._free.pop()
        self._in_use[page] = True
        return page

    def free(self, page: int) -> None:
        """Return ``page``; raises SlotStateError on a double free or a foreign id."""
        if not 0 <= page < self.num_pages or not self._in_use[page]:
            raise SlotStateError(
                f"host {self.component.name} pool: free of page {page} that is not in use"
            )
        self._in_use[page] = False
        self._free.append(page)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def row(self, page: int) -> np.ndarray:
        """The payload bytes of ``page`` as a writable 1-D uint8 array (a view, no copy)."""
        return self.rows[page, FRAME_BYTES : FRAME_BYTES + self.page_bytes]

    def frame(self, page: int) -> np.ndarray:
        """The LMDB header room in front of ``page``'s payload, and the payload: the
        stored value, once the writer has filled the header in."""
        return self.rows[page, FRAME_BYTES - HEADER_BYTES : FRAME_BYTES + self.page_bytes]

    def check_invariants(self, owned: set[int]) -> None:
        """``owned`` (pages the index points at) and the free list partition the pool."""
        free = self._free
        assert len(set(free)) == len(free), f"host {self.component.name}: duplicate free page"
        assert not (set(free) & owned), f"host {self.component.name}: a free page is owned"
        assert len(free) + len(owned) == self.num_pages, (
            f"host {self.component.name}: {len(free)} free + {len(owned)} owned != "
            f"{self.num_pages} pages (a page leaked)"
        )
        in_use = set(np.flatnonzero(self._in_use).tolist())
        assert in_use == owned, f"host {self.component.name}: in-use flags disagree with owners"


def row_bytes(page_bytes: int) -> int:
    """Bytes of one host page with its frame: a multiple of ``FRAME_BYTES``."""
    return FRAME_BYTES + -(-page_bytes // FRAME_BYTES) * FRAME_BYTES


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def host_page_counts(
    layout: ModelLayout, page_size: int, config: ControllerConfig
) -> dict[ComponentType, int]:
    """Pages per component for ``config.host_pool_bytes`` (see the module docstring)."""
    comps = layout.components
    unit = sum(config.host_weight(c) * layout.page_bytes(c, page_size) for c in comps)
    counts = {c: int(config.host_pool_bytes * config.host_weight(c) // unit) for c in comps}
    for c, n in counts.items():
        if n < 1:
            need = math.ceil(unit / config.host_weight(c)) if config.host_weight(c) else 0
            raise ConfigError(
                f"host_pool_bytes={config.host_pool_bytes} leaves no host page for "
                f"{c.name} (page of {layout.page_bytes(c, page_size)} bytes); raise "
                f"host_pool_bytes to at least {need} or host_weight_{c.name.lower()}"
            )
    return counts


@dataclass(frozen=True)
class SharedComponent:
    """One component's shared host pages: ``pages`` rows of ``row_bytes`` in memfd ``fd``."""

    component: ComponentType
    pages: int
    row_bytes: int
    fd: int


@dataclass(frozen=True)
class SharedHostPages:
    """A host pool's pages as engines may map them (``host_shared``): the layout's
    fingerprint (with the page size) and one memfd per component."""

    fingerprint: bytes
    components: list[SharedComponent]


class HostPool:
    """Host pages of every component of one layout."""

    def __init__(
        self,
        layout: ModelLayout,
        page_size: int,
        config: ControllerConfig | None,
        mapped: dict[ComponentType, torch.Tensor] | None = None,
    ) -> None:
        """New pages sized by ``config`` (in a memfd with ``config.host_shared``), or
        (``mapped``, ``config`` None) views over pages another process holds, one
        ``[pages, row_bytes]`` buffer per component."""
        self.layout = layout
        self.page_size = page_size
        if mapped is not None:
            self.components = {
                c: HostComponentPool(
                    c, layout, page_size, b.shape[0], HostPinning.PAGEABLE, buffer=b
                )
                for c, b in mapped.items()
            }
            return
        counts = host_page_counts(layout, page_size, config)
        self.components: dict[ComponentType, HostComponentPool] = {
            c: HostComponentPool(
                c,
                layout,
                page_size,
                n,
                config.host_pinning,
                config.host_shared,
                prefault=config.host_populate,
            )
            for c, n in counts.items()
        }

    def __getitem__(self, component: ComponentType) -> HostComponentPool:
        try:
            return self.components[component]
        except KeyError:
            raise ConfigError(
                f"the layout has no {component.name} component, so there are no host pages for it"
            ) from None

    def kv(self, component: ComponentType) -> torch.Tensor:
        """``[pages, 2, layers, page_size, heads, head_dim]`` of FULL or SWA."""
        view = self[component].kv_view
        assert view is not None, "kv() is for FULL and SWA"
        return view

    def conv(self) -> torch.Tensor:
        """``[pages, mamba_layers, conv_dim, K-1]`` (strided into the page bytes)."""
        return self[ComponentType.MAMBA].conv_view

    def ssm(self) -> torch.Tensor:
        """``[pages, mamba_layers, *ssm_state_shape]`` (strided into the page bytes)."""
        return self[ComponentType.MAMBA].ssm_view

    @property
    def shared(self) -> bool:
        """Whether every component's pages are in a memfd that engines may map."""
        return all(p.shared is not None for p in self.components.values())

    def shared_pages(self) -> SharedHostPages | None:
        """The pool's memfds, for engines to map; None unless every component is shared."""
        if not self.shared:
            return None
        comps = list(self.components.items())
        return SharedHostPages(
            self.layout.fingerprint(self.page_size),
            [SharedComponent(c, p.num_pages, p.row_bytes, p.shared.fd) for c, p in comps],
        )

    # -- residency -----------------------------------------------------------------------

    @property
    def resident_bytes(self) -> int:
        """Host memory the pool holds: every page with its frame, in use or not."""
        return sum(p.num_pages * p.row_bytes for p in self.components.values())

    @property
    def pinned_bytes(self) -> int:
        """The part of :attr:`resident_bytes` that is page-locked."""
        return sum(p.num_pages * p.row_bytes for p in self.components.values() if p.pinned)

    @property
    def used_bytes(self) -> int:
        """Bytes of pages that hold (or are being filled with) a cached page."""
        return sum(p.used_pages * p.page_bytes for p in self.components.values())

    def stats(self) -> dict[str, object]:
        return {
            "resident_bytes": self.resident_bytes,
            "pinned_bytes": self.pinned_bytes,
            "used_bytes": self.used_bytes,
            "capacity_pages": {c.name.lower(): p.num_pages for c, p in self.components.items()},
            "used_pages": {c.name.lower(): p.used_pages for c, p in self.components.items()},
            "page_bytes": {c.name.lower(): p.page_bytes for c, p in self.components.items()},
        }
