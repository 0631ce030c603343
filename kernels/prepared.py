"""Transfers between one fixed pair of buffers: checked once, issued many times.

A controller copies between the same device pool and the same host tensor for its whole
life, a few pages at a time. The functions of :mod:`hicache.kernels` check both tensors'
shapes, work out the row geometry and build a launcher on every call, which for a few
pages costs more host time than the copy's launch. A :class:`PreparedTransfer` does that
once; each call then checks only its indices (given as plain integer sequences, which is
what a controller holds), writes the two index lists into a pinned buffer the kernel
reads, picks the backend by the same rule as the functions, and launches with launchers
built once: on a GPU, after the first, by raw addresses on a raw stream handle through
the compiled variant the first launch chose (``RowLauncher.launch_addrs``), which costs
a fraction of Triton's own launch in host time.

The bytes moved are those of the functions: the same kernels, copy-engine plan, staged
path and torch reference run behind it (``tests/kernels/test_kernels_prepared.py`` compares them).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack, nullcontext

import numpy as np
import torch

from hicache.kernels import reference
from hicache.kernels.geometry import RowCopy, kv_row_copy, state_row_copy
from hicache.kernels.host_indices import PairSlots
from hicache.kernels.tuning import DEFAULT_TUNING, Backend, TransferTuning, parse_backend

Indices = Sequence[int] | np.ndarray

_NO_INDEX = torch.empty(0, dtype=torch.int64)


class PreparedTransfer:
    """Copies between one device buffer set and one host buffer set, in one direction.

    Build it with :meth:`kv` (a KV pool and its host pages) or :meth:`states` (a Mamba
    pool's conv and SSM states and their host pages); call it with the device items
    (pages or state slots) and the host pages, paired one to one. The tensors are held
    for the object's life, so drop it when the pool goes away.

    ``backend`` forces one backend as ``backend=`` of the functions does (tests run the
    Triton interpreter and the staged plan on CPU tensors that way); left None, CUDA
    transfers pick theirs by ``tuning`` and CPU ones take ``Backend.CPU`` (one memmove
    per run of rows; ``backend="torch"`` keeps the reference).
    """

    def __init__(
        self,
        copies: tuple[RowCopy, ...],
        tensors: tuple[torch.Tensor, ...],
        page_size: int,
        to_host: bool,
        device_items: str,
        tuning: TransferTuning,
        backend: Backend | None,
        whole_pages: bool = True,
    ) -> None:
        if backend is Backend.STAGED and not whole_pages:
            raise ValueError("backend='staged' moves whole pages; a copy of some layers cannot")
        self.copies = copies
        self.whole_pages = whole_pages
        self.to_host = to_host
        self.tuning = tuning
        self.backend = backend
        self._tensors = tensors  # the reference's arguments, in its order
        self._page_size = page_size
        self._device_items = device_items
        self._kv = len(copies) == 1  # KV pages (one copy) or Mamba states (conv, SSM)
        dev_side = copies[0].src if to_host else copies[0].dst
        self.device = dev_side.tensor.device
        self.device_limit = dev_side.num_items
        self.host_limit = min((c.dst if to_host else c.src).num_items for c in copies)
        self._launchers: list = [None] * len(copies)
        self._slots = PairSlots()  # pinned index buffers for the kernels' launches

    @classmethod
    def kv(
        cls,
        device_kv: torch.Tensor,
        host_kv: torch.Tensor,
        page_size: int,
        *,
        to_host: bool,
        tuning: TransferTuning = DEFAULT_TUNING,
        backend: Backend | str | None = None,
        layers: tuple[int, int] | None = None,
    ) -> PreparedTransfer:
        """KV pages between ``device_kv`` ``[2, layers, slots, heads, head_dim]`` and
        ``host_kv`` ``[host_pages, 2, layers, page_size, heads, head_dim]``; the shape
        checks of :func:`~hicache.kernels.kv_pages_to_host` run here, once. ``layers``
        ``(lo, hi)``: only those layers of each page move (a layer-wise load)."""
        whole = layers is None
        if not whole:
            lo, n = _layer_span(layers, device_kv.shape[1])
            device_kv, host_kv = device_kv.narrow(1, lo, n), host_kv.narrow(2, lo, n)
        copy = kv_row_copy(
            device_kv, host_kv, _NO_INDEX, _NO_INDEX, page_size, to_host=to_host, whole_pages=whole
        )
        tensors = (device_kv, host_kv) if to_host else (host_kv, device_kv)
        return cls(
            (copy,),
            tensors,
            page_size,
            to_host,
            "device pages",
            tuning,
            parse_backend(backend),
            whole,
        )

    @classmethod
    def states(
        cls,
        conv: torch.Tensor,
        ssm: torch.Tensor,
        host_conv: torch.Tensor,
        host_ssm: torch.Tensor,
        *,
        to_host: bool,
        tuning: TransferTuning = DEFAULT_TUNING,
        backend: Backend | str | None = None,
        layers: tuple[int, int] | None = None,
    ) -> PreparedTransfer:
        """Mamba states (conv and SSM) between a pool's slots and host pages; the checks
        of :func:`~hicache.kernels.mamba_states_to_host` run here, once. ``layers``
        ``(lo, hi)``: only those layers' states move."""
        if layers is not None:
            lo, n = _layer_span(layers, conv.shape[0])
            conv, ssm = conv.narrow(0, lo, n), ssm.narrow(0, lo, n)
            host_conv, host_ssm = host_conv.narrow(1, lo, n), host_ssm.narrow(1, lo, n)
        conv_copy = state_row_copy("conv", conv, host_conv, _NO_INDEX, _NO_INDEX, to_host)
        ssm_copy = state_row_copy("ssm", ssm, host_ssm, _NO_INDEX, _NO_INDEX, to_host)
        if to_host:
            tensors = (conv, ssm, host_conv, host_ssm)
        else:
            tensors = (host_conv, host_ssm, conv, ssm)
        if conv.shape[:2] != ssm.shape[:2] or host_conv.shape[0] != host_ssm.shape[0]:
            raise ValueError(
                f"conv {tuple(conv.shape[:2])} and ssm {tuple(ssm.shape[:2])} must have the same "
                f"layers and slots, host_conv and host_ssm the same pages "
                f"({host_conv.shape[0]} and {host_ssm.shape[0]}): a state is both"
            )
        chosen = parse_backend(backend)
        if chosen is Backend.STAGED:
            raise ValueError(
                "backend='staged' moves KV pages only; use 'triton' or 'copy_engine' for "
                "Mamba states"
            )
        return cls((conv_copy, ssm_copy), tensors, 0, to_host, "state slots", tuning, chosen)

    # -- one transfer ---------------------------------------------------------------------

    def _indices(self, device_items: Indices, host_items: Indices) -> np.ndarray:
        """Both index lists as one ``[2, n]`` int64 array (device row first), checked."""
        if len(device_items) != len(host_items):
            raise ValueError(
                f"{len(device_items)} {self._device_items} but {len(host_items)} host pages; "
                f"they pair up one to one"
            )
        if len(device_items) == 0:
            return np.empty((2, 0), dtype=np.int64)
        try:
            idx = np.array((device_items, host_items))
        except ValueError as exc:
            raise ValueError(f"indices must be flat sequences of integers: {exc}") from None
        if idx.ndim != 2 or idx.dtype.kind not in "iu":
            raise TypeError(
                f"indices must be flat sequences of integers, got {idx.dtype} of shape {idx.shape}"
            )
        idx = idx.astype(np.int64, copy=False)
        dest = idx[1] if self.to_host else idx[0]
        # Sorted, not np.unique: its first call imports numpy.ma (9 ms, a first load's).
        if dest.size > 1 and (np.diff(np.sort(dest)) == 0).any():
            raise ValueError(
                "a destination is named twice: each host page / device item receives one "
                "source, or it would hold a blend of two"
            )
        lo, hi = idx.min(axis=1).tolist(), idx.max(axis=1).tolist()
        for row, (name, limit) in enumerate(
            ((self._device_items, self.device_limit), ("host pages", self.host_limit))
        ):
            if lo[row] < 0 or hi[row] >= limit:
                bad = lo[row] if lo[row] < 0 else hi[row]
                raise IndexError(
                    f"{name} holds {bad}, outside the {limit} {name}; pass ids handed "
                    f"out by the pool that owns the tensor"
                )
        return idx

    def _choose(self, copy: RowCopy, idx: np.ndarray) -> Backend:
        if self.backend is not None:
            return self.backend
        if self.device.type != "cuda":
            return Backend.CPU
        n = idx.shape[1]
        transfer_bytes = dma_bytes = 0
        if self._kv and self.whole_pages:  # the staged path is open to whole KV pages only
            transfer_bytes = n * copy.item_bytes
            if transfer_bytes >= self.tuning.staged_min_transfer_bytes:
                from hicache.kernels.staged import mean_dma_bytes

                host = copy.dst if self.to_host else copy.src
                dma_bytes = mean_dma_bytes(copy, host, idx[1])
        return self.tuning.auto_backend(
            copy.item_bytes, self.to_host, transfer_bytes=transfer_bytes, dma_bytes=dma_bytes
        )

    def __call__(
        self, device_items: Indices, host_items: Indices, stream: int | None = None
    ) -> None:
        """Copy device item ``device_items[i]`` to or from host page ``host_items[i]``.

        Raises IndexError for an index outside its buffer and ValueError for lists of
        different lengths, before anything moves. On a GPU the work is queued on the raw
        stream handle ``stream`` (default: the current stream) and the call returns
        without waiting; on CPU tensors it has finished on return.
        """
        idx = self._indices(device_items, host_items)
        if idx.shape[1] == 0:
            return
        cpu = torch.from_numpy(idx)
        with ExitStack() as launches:
            self._copy(idx, cpu, launches, stream)

    def _copy(
        self, idx: np.ndarray, cpu: torch.Tensor, launches: ExitStack, stream: int | None
    ) -> None:
        on_device = None
        if self.device.type == "cuda" and stream is None:
            stream = torch.cuda.current_stream(self.device).cuda_stream
        for i, copy in enumerate(self.copies):
            chosen = self._choose(copy, idx)
            if chosen is Backend.TORCH:
                with _on_stream(stream, self.device):
                    self._reference(cpu)
                return
            if chosen is Backend.CPU:
                if self.device.type == "cuda":
                    raise ValueError("backend='cpu' needs CPU tensors; use 'triton'")
                from hicache.kernels.cpu_rows import copy_rows_cpu

                src, dst = (idx[0], idx[1]) if self.to_host else (idx[1], idx[0])
                copy_rows_cpu(
                    copy,
                    src,
                    dst,
                    threads=self.tuning.cpu_copy_threads,
                    parallel_min_bytes=self.tuning.cpu_parallel_min_bytes,
                )
                continue
            if chosen is Backend.TRITON:
                if on_device is None:  # the indices, where the kernels read them
                    on_device = self._kernel_indices(idx, cpu, launches, stream)
                self._launch(i, copy, on_device, stream)
                continue
            launches.enter_context(_on_stream(stream, self.device))
            if chosen is Backend.COPY_ENGINE:
                if self.device.type != "cuda":
                    raise ValueError(
                        "backend='copy_engine' needs CUDA tensors; use 'torch' or 'triton'"
                    )
                from hicache.kernels.copy_engine import copy_rows_copy_engine

                src, dst = (cpu[0], cpu[1]) if self.to_host else (cpu[1], cpu[0])
                copy_rows_copy_engine(copy, src, dst)
            else:  # STAGED, KV only
                from hicache.kernels.staged import kv_staged

                kv_staged(copy, cpu[0], cpu[1], self.to_host, self.tuning)

    def row_dmas(
        self, device_items: Indices, host_items: Indices
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This transfer as 1-D copies, one per row of every item of every copy:
        (destination addresses, source addresses, sizes), uint64, for a batched copy on
        the copy engines (``Copies1D``), which takes no SM from kernels running meanwhile.
        The indices are checked as :meth:`__call__` checks them."""
        from hicache.kernels.copy_engine import plan_row_dmas

        idx = self._indices(device_items, host_items)
        src, dst = (idx[0], idx[1]) if self.to_host else (idx[1], idx[0])
        parts = [plan_row_dmas(copy, src, dst) for copy in self.copies]
        return tuple(np.concatenate(arrays) for arrays in zip(*parts))  # type: ignore[return-value]

    def run_copies(
        self, device_items: Indices, host_items: Indices
    ) -> list[tuple[int, int, int, int, int, int]] | None:
        """This transfer as 2-D copies, one per row of each run of items consecutive on
        both sides (``plan_run_copies``: a few large DMAs where the items run), or None
        where a copy's rows cannot go that way. Checked as :meth:`row_dmas`."""
        from hicache.kernels.copy_engine import plan_run_copies

        idx = self._indices(device_items, host_items)
        src, dst = (idx[0], idx[1]) if self.to_host else (idx[1], idx[0])
        out = []
        for copy in self.copies:
            part = plan_run_copies(copy, src, dst)
            if part is None:
                return None
            out += part
        return out

    def shifted_rows(
        self, like: PreparedTransfer, rows: tuple[np.ndarray, np.ndarray, np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """``rows``, which ``like.row_dmas`` made for some items, as this plan's rows for
        the same items, by moving each address by how far this plan's tensors start from
        ``like``'s: for the same copy over other layers of the same tensors (a layer
        group of a layer-wise load), without planning and checking the items again. None
        when the two plans' row grids differ (plan with :meth:`row_dmas` then)."""
        if len(self.copies) != len(like.copies) or self.to_host != like.to_host:
            return None
        per_item = 0
        for mine, theirs in zip(self.copies, like.copies):
            for a, b in ((mine.src, theirs.src), (mine.dst, theirs.dst)):
                same = (a.item_stride, a.a_stride, a.b_stride, a.num_items) == (
                    b.item_stride, b.a_stride, b.b_stride, b.num_items
                )  # fmt: skip
                if not same or a.tensor.element_size() != b.tensor.element_size():
                    return None
            if (mine.rows_a, mine.rows_b, mine.row_elems) != (
                theirs.rows_a, theirs.rows_b, theirs.row_elems
            ):  # fmt: skip
                return None
            per_item += mine.rows_a * mine.rows_b
        dsts, srcs, sizes = rows
        if per_item == 0 or dsts.size % per_item:
            return None
        items = dsts.size // per_item
        dst_shift, src_shift = np.empty_like(dsts), np.empty_like(srcs)
        at = 0
        for mine, theirs in zip(self.copies, like.copies):
            n = items * mine.rows_a * mine.rows_b
            # uint64 wraps: a negative move is the same add modulo 2**64
            dst_shift[at : at + n] = np.uint64(
                (mine.dst.tensor.data_ptr() - theirs.dst.tensor.data_ptr()) % (1 << 64)
            )
            src_shift[at : at + n] = np.uint64(
                (mine.src.tensor.data_ptr() - theirs.src.tensor.data_ptr()) % (1 << 64)
            )
            at += n
        return dsts + dst_shift, srcs + src_shift, sizes

    def warm(self) -> None:
        """Compile (or load) the kernel of every copy that a transfer of a few pages would
        launch, moving nothing: one launch whose only row names no item (a row outside its
        tensor is skipped). A fresh process then pays its kernels' one-time cost here, not
        in its first transfer. Only CUDA copies by Triton launch anything."""
        if self.device.type != "cuda" or self.backend not in (None, Backend.TRITON):
            return
        # Through the pinned index slots every later launch reads (rows 16-byte aligned),
        # so this launch also captures the variant they run (RowLauncher.launch_addrs).
        skip = np.full((2, 1), -1, dtype=np.int64)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        with ExitStack() as launches:
            on_device = None
            for i, copy in enumerate(self.copies):
                chosen = self.tuning.auto_backend(copy.item_bytes, self.to_host)
                if self.backend is Backend.TRITON or chosen is Backend.TRITON:
                    if on_device is None:
                        on_device = self._kernel_indices(skip, None, launches, stream)
                    self._launch(i, copy, on_device, stream)

    def _kernel_indices(
        self, idx: np.ndarray, cpu: torch.Tensor | None, launches: ExitStack, stream: int | None
    ) -> tuple:
        """The index rows as the kernels read them: on a GPU from a pinned buffer that
        stays untouched until the launches in ``launches`` have run (no upload on the
        copy engines, see :mod:`~hicache.kernels.host_indices`), as ``(device rows'
        address, host pages' address, their tensors, their length)``; on a CPU the rows
        as they are."""
        if self.device.type != "cuda":
            return cpu.unbind(0)
        return (*launches.enter_context(self._slots.pair(idx[0], idx[1], stream)), idx.shape[1])

    def _launch(self, i: int, copy: RowCopy, on_device: tuple, stream: int | None) -> None:
        """Copy ``i``'s kernel over the indices of :meth:`_kernel_indices`: on a GPU by
        their addresses through the variant its first launch here chose (no per-call
        binding: ``RowLauncher.launch_addrs``), that first launch through Triton's own."""
        launcher = self._launchers[i]
        if launcher is None:
            from hicache.kernels.triton_transfer import RowLauncher

            launcher = self._launchers[i] = RowLauncher(copy, self.tuning)
        if self.device.type != "cuda":
            dev, host = on_device
            launcher.launch(*((dev, host) if self.to_host else (host, dev)))
            return
        dev_addr, host_addr, tensors, n = on_device
        src, dst = (dev_addr, host_addr) if self.to_host else (host_addr, dev_addr)
        if launcher.launch_addrs(src, dst, n, stream):
            return
        dev, host = tensors()
        with _on_stream(stream, self.device):
            launcher.launch(*((dev, host) if self.to_host else (host, dev)), capture=True)

    def _reference(self, cpu: torch.Tensor) -> None:
        dev, host = cpu[0], cpu[1]
        t = self._tensors
        if self._kv:
            if self.to_host:
                reference.kv_pages_to_host_ref(t[0], t[1], dev, host, self._page_size)
            else:
                reference.kv_pages_to_device_ref(t[0], t[1], host, dev, self._page_size)
        elif self.to_host:
            reference.mamba_states_to_host_ref(*t, dev, host)
        else:
            reference.mamba_states_to_device_ref(*t, host, dev)


def _on_stream(stream: int | None, device: torch.device):
    """Torch's current stream set to the raw handle ``stream`` (None: left as it is), for
    the launches that take theirs from torch."""
    if stream is None or device.type != "cuda":
        return nullcontext()
    if torch.cuda.current_stream(device).cuda_stream == stream:
        return nullcontext()
    return torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device))


def _layer_span(layers: tuple[int, int], num_layers: int) -> tuple[int, int]:
    """``(lo, hi)`` of a layer-wise copy as ``(lo, count)``; ValueError outside the pool."""
    lo, hi = layers
    if not 0 <= lo < hi <= num_layers:
        raise ValueError(f"layers {layers} are not a non-empty range of the {num_layers} layers")
    return lo, hi - lo
