"""KV page and Mamba state transfers: Triton (interpreted on CPU) vs torch reference vs a
plain Python loop, bit for bit, on fresh random inputs with poisoned outputs."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import hicache.kernels as kernels
from hicache import CacheConfig, DevicePools, ModelLayout
from hicache.kernels import Backend, reference
from hicache.kernels.copy_engine import plan_2d_copies
from hicache.kernels.geometry import kv_row_copy
from tests.support.bits import bits, randomize

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def host_pages_view(n_pages: int, page_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``[n_pages, *page_shape]`` as a strided view into a larger byte buffer (each page is
    followed by padding), the way a host pool hands out pages."""
    page_bytes = dtype.itemsize * int(torch.Size(page_shape).numel())
    buf = torch.empty((n_pages, page_bytes + 64), dtype=torch.uint8)
    return buf[:, :page_bytes].view(dtype).view(n_pages, *page_shape)


def loop_kv_to_host(device_kv, host_kv, device_pages, host_pages, page_size):
    for p, h in zip(device_pages.tolist(), host_pages.tolist()):
        host_kv[h] = device_kv[:, :, p * page_size : (p + 1) * page_size]


def loop_kv_to_device(host_kv, device_kv, host_pages, device_pages, page_size):
    for h, p in zip(host_pages.tolist(), device_pages.tolist()):
        device_kv[:, :, p * page_size : (p + 1) * page_size] = host_kv[h]


def run_three(fn_triton, fn_ref, fn_loop, out: torch.Tensor) -> list[torch.Tensor]:
    """Run the three implementations on identical poisoned copies of ``out``."""
    results = []
    for fn in (fn_triton, fn_ref, fn_loop):
        target = out.clone()
        fn(target)
        results.append(target)
    return results


def assert_same_bits(results: list[torch.Tensor]) -> None:
    first = bits(results[0])
    for other in results[1:]:
        assert torch.equal(first, bits(other))


LAYERS, HEADS, HEAD_DIM = 3, 2, 8


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_round_trip_matches_reference_and_loop(page_size: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1000 * page_size + dtype.itemsize)
    num_pages, host_n = 12, 9
    device_kv = randomize(
        torch.empty(2, LAYERS, num_pages * page_size, HEADS, HEAD_DIM, dtype=dtype), gen
    )
    host_kv = randomize(
        host_pages_view(host_n, (2, LAYERS, page_size, HEADS, HEAD_DIM), dtype), gen
    )
    # Device page 4 goes to two host pages: duplicate sources are legal.
    device_pages = torch.tensor([4, 11, 0, 4, 7])
    host_pages = torch.randperm(host_n, generator=gen)[:5]

    to_host = run_three(
        lambda h: kernels.kv_pages_to_host(
            device_kv, h, device_pages, host_pages, page_size, backend="triton"
        ),
        lambda h: reference.kv_pages_to_host_ref(device_kv, h, device_pages, host_pages, page_size),
        lambda h: loop_kv_to_host(device_kv, h, device_pages, host_pages, page_size),
        host_kv,
    )
    assert_same_bits(to_host)
    written = torch.zeros(host_n, dtype=torch.bool)
    written[host_pages] = True
    assert not torch.equal(bits(to_host[0][written]), bits(host_kv[written]))
    assert torch.equal(bits(to_host[0][~written]), bits(host_kv[~written]))

    # Back into other device pages of a freshly poisoned pool.
    loaded = to_host[0]
    back_pages = torch.tensor([9, 2, 5, 1, 10])
    target = randomize(torch.empty_like(device_kv), gen)
    to_device = run_three(
        lambda d: kernels.kv_pages_to_device(
            loaded, d, host_pages, back_pages, page_size, backend="triton"
        ),
        lambda d: reference.kv_pages_to_device_ref(loaded, d, host_pages, back_pages, page_size),
        lambda d: loop_kv_to_device(loaded, d, host_pages, back_pages, page_size),
        target,
    )
    assert_same_bits(to_device)
    paged = to_device[0].view(2, LAYERS, num_pages, page_size, HEADS, HEAD_DIM)
    original = device_kv.view(2, LAYERS, num_pages, page_size, HEADS, HEAD_DIM)
    assert torch.equal(bits(paged[:, :, back_pages]), bits(original[:, :, device_pages]))
    untouched = torch.ones(num_pages, dtype=torch.bool)
    untouched[back_pages] = False
    poisoned = target.view(2, LAYERS, num_pages, page_size, HEADS, HEAD_DIM)
    assert torch.equal(bits(paged[:, :, untouched]), bits(poisoned[:, :, untouched]))


@pytest.mark.parametrize("tile_bytes", [96, 256, 1 << 20])
def test_kv_transfer_with_partial_tiles_and_odd_rows(tile_bytes: int) -> None:
    """Rows that are no power of two, split over several column tiles (the last one
    partial), several rows per tile, and more tiles than programs."""
    gen = torch.Generator().manual_seed(tile_bytes)
    page_size, heads, head_dim = 16, 3, 6
    device_kv = randomize(torch.empty(2, 2, 10 * page_size, heads, head_dim).half(), gen)
    host_kv = randomize(host_pages_view(7, (2, 2, page_size, heads, head_dim), torch.half), gen)
    device_pages, host_pages = torch.tensor([8, 1, 3]), torch.tensor([0, 6, 2])
    tuning = kernels.TransferTuning(tile_bytes=tile_bytes)
    got, want = host_kv.clone(), host_kv.clone()
    kernels.kv_pages_to_host(
        device_kv, got, device_pages, host_pages, page_size, backend="triton", tuning=tuning
    )
    reference.kv_pages_to_host_ref(device_kv, want, device_pages, host_pages, page_size)
    assert torch.equal(bits(got), bits(want))


def test_full_and_swa_pools_of_a_hybrid_layout_round_trip() -> None:
    layout = ModelLayout(
        ("full", "swa", "mamba", "swa", "full"),
        num_kv_heads=2,
        head_dim=8,
        dtype="bfloat16",
        conv_dim=6,
        conv_kernel=4,
        ssm_state_shape=(2, 3, 4),
        state_dtype="float32",
    )
    config = CacheConfig(page_size=4, sliding_window=8, full_slots=64, mamba_slots=4)
    pools = DevicePools.allocate(layout, config)
    gen = torch.Generator().manual_seed(7)
    for pool in (pools.full, pools.swa):
        randomize(pool.buffer, gen)
        original = pool.buffer.clone()
        host = host_pages_view(6, (2, len(pool.layers), 4, 2, 8), torch.bfloat16)
        pages = torch.from_numpy(pool.alloc_pages(3))
        host_ids = torch.tensor([5, 0, 3])
        kernels.kv_pages_to_host(pool.buffer, host, pages, host_ids, 4, backend="triton")
        randomize(pool.buffer, gen)
        kernels.kv_pages_to_device(host, pool.buffer, host_ids, pages, 4, backend="triton")
        slots = torch.from_numpy(pool.pages_to_slots(pages.numpy()))
        assert torch.equal(bits(pool.buffer[:, :, slots]), bits(original[:, :, slots]))


class MambaHostPages:
    """Host conv and SSM pages as strided views into one byte buffer per page (conv bytes,
    then SSM bytes, then padding), the way a host pool lays out a Mamba page."""

    def __init__(self, n_pages: int, layers: int, conv_shape, ssm_shape, dtype) -> None:
        self.conv_shape = (n_pages, layers, *conv_shape)
        self.ssm_shape = (n_pages, layers, *ssm_shape)
        self.dtype = dtype
        self.conv_bytes = layers * int(torch.Size(conv_shape).numel()) * dtype.itemsize
        self.ssm_bytes = layers * int(torch.Size(ssm_shape).numel()) * dtype.itemsize
        self.buffer = torch.empty(
            (n_pages, self.conv_bytes + self.ssm_bytes + 32), dtype=torch.uint8
        )

    def views(self, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, s = self.conv_bytes, self.ssm_bytes
        conv = buffer[:, :c].view(self.dtype).view(self.conv_shape)
        return conv, buffer[:, c : c + s].view(self.dtype).view(self.ssm_shape)


def loop_mamba_to_host(conv, ssm, host_conv, host_ssm, slots, host_pages):
    for s, h in zip(slots.tolist(), host_pages.tolist()):
        host_conv[h] = conv[:, s]
        host_ssm[h] = ssm[:, s]


def loop_mamba_to_device(host_conv, host_ssm, conv, ssm, host_pages, slots):
    for h, s in zip(host_pages.tolist(), slots.tolist()):
        conv[:, s] = host_conv[h]
        ssm[:, s] = host_ssm[h]


@pytest.mark.parametrize("dtype", DTYPES)
def test_mamba_state_round_trip_matches_reference_and_loop(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(31 + dtype.itemsize)
    layers, num_slots = 3, 7
    conv_shape, ssm_shape = (10, 3), (2, 4, 5)
    # One pool tensor holding conv then SSM, so that all three runs act on one clone.
    conv_n = layers * num_slots * 30
    pool = randomize(torch.empty(conv_n + layers * num_slots * 40, dtype=dtype), gen)

    def pool_views(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        conv = flat[:conv_n].view(layers, num_slots, *conv_shape)
        return conv, flat[conv_n:].view(layers, num_slots, *ssm_shape)

    conv, ssm = pool_views(pool)
    host = MambaHostPages(6, layers, conv_shape, ssm_shape, dtype)
    randomize(host.buffer, gen)
    slots, host_pages = torch.tensor([6, 0, 3]), torch.tensor([2, 5, 0])

    stored = run_three(
        lambda b: kernels.mamba_states_to_host(
            conv, ssm, *host.views(b), slots, host_pages, backend="triton"
        ),
        lambda b: reference.mamba_states_to_host_ref(conv, ssm, *host.views(b), slots, host_pages),
        lambda b: loop_mamba_to_host(conv, ssm, *host.views(b), slots, host_pages),
        host.buffer,
    )
    assert_same_bits(stored)
    assert torch.equal(stored[0][[1, 3, 4]], host.buffer[[1, 3, 4]])  # untouched pages

    host_conv, host_ssm = host.views(stored[0])
    back_slots = torch.tensor([1, 4, 2])
    target = randomize(torch.empty_like(pool), gen)
    loaded = run_three(
        lambda f: kernels.mamba_states_to_device(
            host_conv, host_ssm, *pool_views(f), host_pages, back_slots, backend="triton"
        ),
        lambda f: reference.mamba_states_to_device_ref(
            host_conv, host_ssm, *pool_views(f), host_pages, back_slots
        ),
        lambda f: loop_mamba_to_device(host_conv, host_ssm, *pool_views(f), host_pages, back_slots),
        target,
    )
    assert_same_bits(loaded)
    new_conv, new_ssm = pool_views(loaded[0])
    assert torch.equal(bits(new_conv[:, back_slots]), bits(conv[:, slots]))
    assert torch.equal(bits(new_ssm[:, back_slots]), bits(ssm[:, slots]))
    old_conv, old_ssm = pool_views(target)
    others = [0, 3, 5, 6]
    assert torch.equal(bits(new_conv[:, others]), bits(old_conv[:, others]))
    assert torch.equal(bits(new_ssm[:, others]), bits(old_ssm[:, others]))


def test_kernel_skips_rows_with_out_of_range_indices() -> None:
    """Indices on a GPU are not read back on the host; the kernel must skip bad ones."""
    from hicache.kernels.triton_transfer import copy_rows

    gen = torch.Generator().manual_seed(5)
    device_kv = randomize(torch.empty(2, 2, 8, 2, 4, dtype=torch.float32), gen)
    host_kv = randomize(torch.empty(4, 2, 2, 2, 2, 4, dtype=torch.float32), gen)
    expected = host_kv.clone()
    good = torch.tensor([1])
    copy = kv_row_copy(device_kv, host_kv, good, good, 2, to_host=True)
    copy_rows(copy, torch.tensor([1, -3, 4, 2]), torch.tensor([0, 1, 2, 7]))
    expected[0] = device_kv[:, :, 2:4]
    assert torch.equal(bits(host_kv), bits(expected))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_out_of_range_cpu_index_raises_and_changes_nothing(backend: str) -> None:
    device_kv = torch.randn(2, 2, 8, 2, 4)
    host_kv = torch.randn(3, 2, 2, 4, 2, 4)
    before = host_kv.clone()
    with pytest.raises(IndexError, match="device_pages holds 2, outside the 2 device pages"):
        kernels.kv_pages_to_host(
            device_kv, host_kv, torch.tensor([0, 2]), torch.tensor([0, 1]), 4, backend=backend
        )
    with pytest.raises(IndexError, match="host_pages holds -1"):
        kernels.kv_pages_to_host(
            device_kv, host_kv, torch.tensor([0]), torch.tensor([-1]), 4, backend=backend
        )
    assert torch.equal(host_kv, before)


def test_bad_arguments_say_what_is_wrong() -> None:
    device_kv = torch.zeros(2, 2, 8, 2, 4)
    host_kv = torch.zeros(3, 2, 2, 4, 2, 4)
    pages = torch.tensor([0])
    with pytest.raises(ValueError, match="divide the pool's 8 slots"):
        kernels.kv_pages_to_host(device_kv, host_kv, pages, pages, 3)
    with pytest.raises(ValueError, match=r"host_kv must be \[host_pages, 2, 2, 2, 2, 4\]"):
        kernels.kv_pages_to_host(device_kv, host_kv, pages, pages, 2)
    with pytest.raises(TypeError, match=r"host_kv is torch\.float16 but device_kv"):
        kernels.kv_pages_to_host(device_kv, host_kv.half(), pages, pages, 4)
    with pytest.raises(TypeError, match="must hold integers"):
        kernels.kv_pages_to_host(device_kv, host_kv, pages.float(), pages, 4)
    with pytest.raises(ValueError, match="they pair up one to one"):
        kernels.kv_pages_to_host(device_kv, host_kv, torch.tensor([0, 1]), pages, 4)
    with pytest.raises(ValueError, match="backend='gpu' is not one of"):
        kernels.kv_pages_to_host(device_kv, host_kv, pages, pages, 4, backend="gpu")
    with pytest.raises(ValueError, match="copy_engine' needs CUDA tensors"):
        kernels.kv_pages_to_host(device_kv, host_kv, pages, pages, 4, backend=Backend.COPY_ENGINE)
    square = torch.zeros(2, 2, 8, 4, 4)  # heads == head_dim, so a transpose keeps the shape
    with pytest.raises(ValueError, match="dense in its"):
        kernels.kv_pages_to_host(
            square.transpose(3, 4), torch.zeros(3, 2, 2, 4, 4, 4), pages, pages, 4
        )


def _run_python(code: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_triton_kernels_under_triton_interpret_env() -> None:
    """With TRITON_INTERPRET=1 set before triton is imported, @triton.jit itself yields
    interpreted kernels; the transfers and scatters must give the reference's bytes."""
    code = """
        import torch
        import triton.runtime.interpreter as interp
        import hicache.kernels as k
        from hicache.kernels import reference as ref, triton_transfer, triton_spec
        assert isinstance(triton_transfer._copy_rows_kernel, interp.InterpretedFunction)
        g = torch.Generator().manual_seed(3)
        dev = torch.randn(2, 2, 32, 2, 8, generator=g).half()
        host = torch.zeros(5, 2, 2, 16, 2, 8).half()
        dp, hp = torch.tensor([1, 0]), torch.tensor([4, 2])
        k.kv_pages_to_host(dev, host, dp, hp, 16, backend="triton")
        want = torch.zeros_like(host)
        ref.kv_pages_to_host_ref(dev, want, dp, hp, 16)
        assert torch.equal(host.view(torch.int16), want.view(torch.int16))
        dst = torch.randn(2, 4, 3, 3, generator=g)
        src = torch.randn(2, 3, 4, 3, 3, generator=g)
        di, st = torch.tensor([2, 0, 2]), torch.tensor([3, -1, 0])
        want = dst.clone()
        ref.fused_conv_window_scatter_with_mask_ref(want, src, di, st)
        k.fused_conv_window_scatter_with_mask(dst, src, di, st, backend="triton")
        assert torch.equal(dst, want)
        print("ok")
    """
    done = _run_python(code, {"TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_cpu_default_path_needs_no_triton() -> None:
    code = """
        import sys, torch
        import hicache.kernels as k
        dev = torch.randn(2, 1, 4, 1, 2)
        host = torch.zeros(2, 2, 1, 2, 1, 2)
        k.kv_pages_to_host(dev, host, torch.tensor([1]), torch.tensor([0]), 2)
        assert torch.equal(host[0], dev[:, :, 2:4])
        assert "triton" not in sys.modules
        print("ok")
    """
    done = _run_python(code, {})
    assert done.returncode == 0, done.stderr


def test_copy_engines_take_only_large_items_by_default() -> None:
    tuning = kernels.TransferTuning(
        copy_engine_min_item_bytes_to_host=8 << 20, copy_engine_min_item_bytes_to_device=2 << 20
    )
    assert tuning.auto_backend(8 << 20, to_host=True) is Backend.COPY_ENGINE
    assert tuning.auto_backend((8 << 20) - 1, to_host=True) is Backend.TRITON
    assert tuning.auto_backend(2 << 20, to_host=False) is Backend.COPY_ENGINE
    assert tuning.auto_backend(128 << 10, to_host=False) is Backend.TRITON
    # One Llama-3-8B page of 64 tokens (8 MiB) goes to the copy engines with the defaults,
    # a page of 16 tokens (2 MiB) to Triton.
    copy = kv_row_copy(
        torch.empty(2, 32, 128, 8, 128, dtype=torch.bfloat16),
        torch.empty(1, 2, 32, 64, 8, 128, dtype=torch.bfloat16),
        torch.tensor([0]),
        torch.tensor([0]),
        64,
        to_host=True,
    )
    assert copy.item_bytes == 8 << 20
    assert kernels.TransferTuning().auto_backend(copy.item_bytes, True) is Backend.COPY_ENGINE
    assert kernels.TransferTuning().auto_backend(2 << 20, True) is Backend.TRITON


def emulate_2d_copies(plan) -> None:
    """What cudaMemcpy2DAsync does, row by row, on CPU memory."""
    for dst, dst_pitch, src, src_pitch, width, height in plan:
        for row in range(height):
            ctypes.memmove(dst + row * dst_pitch, src + row * src_pitch, width)


@pytest.mark.parametrize("layer_slice", [slice(None), slice(1, 3)])
def test_copy_engine_plan_moves_the_reference_bytes(layer_slice: slice) -> None:
    """The copy-engine path's addresses, checked on CPU memory: a whole pool (one 2-D copy
    per page across K, V and all layers) and a layer-sliced view of it (whose K and V
    blocks are not evenly spaced, so each page takes one copy per K/V half)."""
    gen = torch.Generator().manual_seed(17)
    pool = randomize(torch.empty(2, 4, 6 * 4, 2, 8, dtype=torch.float16), gen)
    device_kv = pool[:, layer_slice]
    layers = device_kv.shape[1]
    host = randomize(host_pages_view(5, (2, layers, 4, 2, 8), torch.float16), gen)
    device_pages, host_pages = torch.tensor([5, 0, 3]), torch.tensor([1, 4, 0])
    want = host.clone()
    reference.kv_pages_to_host_ref(device_kv, want, device_pages, host_pages, 4)

    copy = kv_row_copy(device_kv, host, device_pages, host_pages, 4, to_host=True)
    plan = plan_2d_copies(copy, device_pages.numpy(), host_pages.numpy())
    assert len(plan) == (3 if layer_slice == slice(None) else 6)
    emulate_2d_copies(plan)
    assert torch.equal(bits(host), bits(want))

    back = randomize(torch.empty_like(pool), gen)
    back_view = back[:, layer_slice]
    copy = kv_row_copy(back_view, host, device_pages, host_pages, 4, to_host=False)
    emulate_2d_copies(plan_2d_copies(copy, host_pages.numpy(), device_pages.numpy()))
    paged = back_view.reshape(2, layers, 6, 4, 2, 8)
    original = device_kv.reshape(2, layers, 6, 4, 2, 8)
    assert torch.equal(bits(paged[:, :, device_pages]), bits(original[:, :, device_pages]))

    with pytest.raises(IndexError, match="destination index is outside its 6 items"):
        plan_2d_copies(copy, host_pages.numpy(), np.array([0, 6, 1]))


def test_grid_limit_caps_the_persistent_grid_on_a_gpu(monkeypatch) -> None:
    """A layer-wise load's copies hold at most ``grid_limit`` programs (the SMs left to
    the engine's compute); without a limit the grid is ``programs_per_sm`` per SM, and a
    negative limit is refused."""
    from hicache.kernels import launch
    from hicache.kernels.tuning import LAYER_COPY_TUNING

    monkeypatch.setattr(launch, "_sm_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    assert launch.max_programs(gpu, kernels.TransferTuning()) == 264
    assert launch.max_programs(gpu, LAYER_COPY_TUNING) == LAYER_COPY_TUNING.grid_limit < 264
    assert launch.max_programs(gpu, kernels.TransferTuning(grid_limit=1000)) == 264
    cpu = torch.device("cpu")
    assert launch.max_programs(cpu, LAYER_COPY_TUNING) == LAYER_COPY_TUNING.interpreter_programs
    with pytest.raises(ValueError, match="grid_limit"):
        kernels.TransferTuning(grid_limit=-1)
