"""The reference model: logits, KV and Mamba state are bit-identical under any chunking.

The scenarios run one token sequence several ways (one chunk, page-aligned chunks, token
by token, ragged chunks, resumed from a prefix computed elsewhere, batched with other
requests) and require ``torch.equal`` logits, byte-identical KV in the pools and
byte-identical Mamba state.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from hicache import CacheConfig, ConfigError, DevicePools, ModelLayout, Request, UnifiedRadixCache
from hicache.apps.engine import (
    HybridModel,
    ModelConfig,
    SequenceChunk,
    exact,
    generate,
    page_boundaries,
    tiny_hybrid,
    tiny_hybrid_layout,
)
from hicache.types import PoolExhaustedError

KINDS = {
    "full": ("full", "full"),
    "full+swa": ("swa", "full", "swa"),
    "full+mamba": ("mamba", "full", "mamba"),
    "hybrid": ("full", "swa", "mamba", "full"),
}

# (layout name, page size, sliding window): windows smaller and larger than a page.
MATRIX = [
    ("full", 1, None),
    ("full", 16, None),
    ("full+swa", 1, 5),
    ("full+swa", 16, 5),
    ("full+swa", 16, 40),
    ("full+mamba", 1, None),
    ("full+mamba", 16, None),
    ("hybrid", 1, 7),
    ("hybrid", 16, 5),
    ("hybrid", 16, 40),
]


def build(name: str, page_size: int, window: int | None, **dtypes: torch.dtype):
    spec = tiny_hybrid(
        KINDS[name],
        page_size=page_size,
        sliding_window=window or 8,
        full_slots=4096,
        mamba_slots=16,
        **dtypes,
    )
    return spec.build()


@dataclass
class Run:
    """One sequence processed in one chunking, with the slots it used."""

    logits: torch.Tensor
    slots: np.ndarray
    mamba_slot: int | None


def alloc_sequence(pools: DevicePools, length: int) -> tuple[np.ndarray, int | None]:
    pages = pools.alloc_kv_pages(-(-length // pools.full.page_size))
    slot = None
    if pools.mamba is not None:
        slot = pools.mamba.alloc_state()
        pools.mamba.conv[:, slot].zero_()
        pools.mamba.ssm[:, slot].zero_()
    return pools.full.pages_to_slots(pages)[:length], slot


def run_chunks(
    model: HybridModel,
    pools: DevicePools,
    tokens: torch.Tensor,
    sizes: list[int],
    slots: np.ndarray | None = None,
    mamba_slot: int | None = None,
    start: int = 0,
) -> Run:
    """Process ``tokens[start:]`` in chunks of ``sizes``; slots are allocated if not given."""
    if slots is None:
        slots, mamba_slot = alloc_sequence(pools, tokens.numel())
    assert sum(sizes) == tokens.numel() - start
    outs = []
    for size in sizes:
        end = start + size
        outs.append(
            model.forward(
                pools, tokens[start:end], torch.arange(start, end), slots[:end], mamba_slot
            )
        )
        start = end
    return Run(torch.cat(outs), slots, mamba_slot)


def kv_bytes(pools: DevicePools, slots: np.ndarray, first: int = 0) -> list[bytes]:
    """The raw K/V bytes of the sequence's tokens (SWA from token ``first`` on)."""
    out = [pools.full.buffer[:, :, torch.as_tensor(slots)].contiguous().view(torch.uint8)]
    if pools.swa is not None:
        swa = torch.as_tensor(pools.swa_slots_of(slots[first:]))
        out.append(pools.swa.buffer[:, :, swa].contiguous().view(torch.uint8))
    return [t.numpy().tobytes() for t in out]


def state_bytes(pools: DevicePools, slot: int | None) -> bytes:
    if pools.mamba is None:
        return b""
    conv = pools.mamba.conv[:, slot].contiguous().view(torch.uint8)
    ssm = pools.mamba.ssm[:, slot].contiguous().view(torch.uint8)
    return conv.numpy().tobytes() + ssm.numpy().tobytes()


def chunkings(length: int, page_size: int, rng: random.Random) -> dict[str, list[int]]:
    """Named chunkings of ``length`` tokens."""

    def page_aligned() -> list[int]:
        sizes, done = [], 0
        while done < length:
            size = min(page_size * rng.randint(1, 3), length - done)
            sizes.append(size)
            done += size
        return sizes

    def ragged() -> list[int]:
        sizes, done = [], 0
        while done < length:
            size = min(rng.randint(1, 2 * page_size + 3), length - done)
            sizes.append(size)
            done += size
        return sizes

    prefill = page_size * max(1, (length // 2) // page_size)
    return {
        "pages": page_aligned(),
        "decode": [1] * length,
        "prefill+decode": [prefill] + [1] * (length - prefill),
        "ragged": ragged(),
    }


def random_tokens(n: int, seed: int, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


# -- the exact primitives ------------------------------------------------------------------


def test_exp_is_accurate_and_exact_at_zero():
    x = torch.linspace(-700.0, 700.0, 200_001, dtype=torch.float64)
    rel = ((exact.exp(x) - torch.exp(x)) / torch.exp(x)).abs().max().item()
    assert rel < 1e-9
    assert torch.equal(exact.exp(torch.zeros(5)), torch.ones(5, dtype=torch.float64))


def test_exp_of_an_element_does_not_depend_on_its_place_in_the_tensor():
    values = torch.randn(333, generator=torch.Generator().manual_seed(3)) * 20
    alone = torch.stack([exact.exp(v.reshape(1))[0] for v in values[:40]])
    for pad in (1, 7, 17):
        shifted = exact.exp(torch.cat([torch.zeros(pad), values]))[pad:]
        assert torch.equal(shifted, exact.exp(values))
    assert torch.equal(alone, exact.exp(values)[:40])


def test_linear_row_results_do_not_depend_on_the_other_rows():
    gen = torch.Generator().manual_seed(4)
    layer = exact.Linear(torch.randn(64, 40, generator=gen) / 8)
    rows = torch.randn(37, 64, generator=gen)
    together = layer(rows)
    for i in (0, 5, 36):
        assert torch.equal(layer(rows[i : i + 1])[0], together[i])
    assert torch.equal(layer(rows.flip(0)).flip(0), together)


def test_fixed_point_sums_are_exact_in_any_order():
    gen = torch.Generator().manual_seed(5)
    a = exact.PROBABILITY.encode(torch.rand(4096, generator=gen))
    b = exact.VALUE.encode(torch.randn(4096, generator=gen) * 10)
    products = a * b
    perm = torch.randperm(4096, generator=gen)
    forward = products.sum()
    assert torch.equal(products[perm].sum(), forward)
    assert torch.equal(products.flip(0).cumsum(0)[-1], forward)
    assert float(forward) == sum(int(x) for x in products.tolist())  # the exact integer sum


# -- chunking invariance -------------------------------------------------------------------


@pytest.mark.parametrize(("name", "page_size", "window"), MATRIX)
def test_every_chunking_gives_identical_logits_kv_and_state(name, page_size, window):
    model, pools = build(name, page_size, window)
    length = 3 * page_size + 11 if page_size > 1 else 45
    tokens = random_tokens(length, seed=page_size)
    reference = run_chunks(model, pools, tokens, [length])
    ref_kv = kv_bytes(pools, reference.slots)
    ref_state = state_bytes(pools, reference.mamba_slot)
    assert torch.isfinite(reference.logits).all()

    for how, sizes in chunkings(length, page_size, random.Random(length)).items():
        run = run_chunks(model, pools, tokens, sizes)
        assert torch.equal(run.logits, reference.logits), how
        assert kv_bytes(pools, run.slots) == ref_kv, how
        assert state_bytes(pools, run.mamba_slot) == ref_state, how


@pytest.mark.parametrize(
    ("name", "page_size", "window"),
    [("full+swa", 16, 5), ("hybrid", 1, 7), ("hybrid", 16, 40), ("full+mamba", 16, None)],
)
def test_resuming_from_a_prefix_copied_to_other_slots_matches_one_pass(name, page_size, window):
    """A prefix computed in one chunking, copied page by page (as a load-back does) into
    fresh slots, and continued in another chunking gives the one-pass logits."""
    model, pools = build(name, page_size, window)
    prefix_pages = 3 if page_size > 1 else 20
    prefix = prefix_pages * page_size
    length = prefix + 2 * page_size + 5
    tokens = random_tokens(length, seed=11)
    reference = run_chunks(model, pools, tokens, [length])

    first = run_chunks(model, pools, tokens[:prefix], [page_size] * prefix_pages)
    slots, mamba_slot = alloc_sequence(pools, length)
    src, dst = torch.as_tensor(first.slots), torch.as_tensor(slots[:prefix])
    pools.full.buffer[:, :, dst] = pools.full.buffer[:, :, src]
    if pools.swa is not None:
        src_swa = torch.as_tensor(pools.swa_slots_of(first.slots))
        dst_swa = torch.as_tensor(pools.swa_slots_of(slots[:prefix]))
        pools.swa.buffer[:, :, dst_swa] = pools.swa.buffer[:, :, src_swa]
    if pools.mamba is not None:
        pools.mamba.copy_state(first.mamba_slot, mamba_slot)

    rest = [1, page_size + 2] + [1] * (length - prefix - page_size - 3)
    resumed = run_chunks(model, pools, tokens, rest, slots, mamba_slot, start=prefix)
    assert torch.equal(resumed.logits, reference.logits[prefix:])
    assert kv_bytes(pools, resumed.slots) == kv_bytes(pools, reference.slots)
    assert state_bytes(pools, resumed.mamba_slot) == state_bytes(pools, reference.mamba_slot)


def test_decoding_after_swa_pages_outside_the_window_are_freed_is_unchanged():
    page_size, window = 4, 6
    model, pools = build("hybrid", page_size, window)
    length = 40
    tokens = random_tokens(length, seed=12)
    reference = run_chunks(model, pools, tokens, [length])

    run = run_chunks(model, pools, tokens[:24], [8, 8, 8])
    slots, mamba_slot = alloc_sequence(pools, length)
    pools.full.buffer[:, :, torch.as_tensor(slots[:24])] = pools.full.buffer[
        :, :, torch.as_tensor(run.slots)
    ]
    pools.mamba.copy_state(run.mamba_slot, mamba_slot)
    swa_src = torch.as_tensor(pools.swa_slots_of(run.slots))
    swa_dst = torch.as_tensor(pools.swa_slots_of(slots[:24]))
    pools.swa.buffer[:, :, swa_dst] = pools.swa.buffer[:, :, swa_src]
    # Token 24 looks back to token 19 (page 4): pages 0-3 are outside every later window.
    freed_pages = np.unique(slots[:16] // page_size)
    pools.free_swa_of(freed_pages)
    assert np.all(pools.swa_slots_of(slots[:16]) == -1)

    resumed = run_chunks(model, pools, tokens, [1] * 16, slots, mamba_slot, start=24)
    assert torch.equal(resumed.logits, reference.logits[24:])


def test_bf16_state_and_float32_kv_are_chunking_invariant_too():
    model, pools = build("hybrid", 16, 20, dtype=torch.float32, state_dtype=torch.bfloat16)
    tokens = random_tokens(50, seed=13)
    reference = run_chunks(model, pools, tokens, [50])
    for sizes in ([16, 16, 16, 2], [1] * 50, [32, 1, 1, 16]):
        run = run_chunks(model, pools, tokens, sizes)
        assert torch.equal(run.logits, reference.logits)
        assert state_bytes(pools, run.mamba_slot) == state_bytes(pools, reference.mamba_slot)


# -- batching ------------------------------------------------------------------------------


def test_batched_decode_and_mixed_batches_match_each_request_alone():
    model, pools = build("hybrid", 4, 6)
    lengths = [5, 13, 30, 21]
    seqs = [random_tokens(n + 3, seed=20 + i) for i, n in enumerate(lengths)]
    alone = [run_chunks(model, pools, s, [s.numel()]) for s in seqs]

    batched = [alloc_sequence(pools, s.numel()) for s in seqs]
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    # A mixed first batch (prefill chunks of different lengths), then batched decode.
    first = [
        SequenceChunk(s[:n], torch.arange(n), slots[:n], ms)
        for s, n, (slots, ms) in zip(seqs, lengths, batched)
    ]
    for i, out in enumerate(model.forward_batch(pools, first)):
        outs[i].append(out.logits)
    for step in range(3):
        chunks = [
            SequenceChunk(s[n + step : n + step + 1], [n + step], slots[: n + step + 1], ms)
            for s, n, (slots, ms) in zip(seqs, lengths, batched)
        ]
        for i, out in enumerate(model.forward_batch(pools, chunks)):
            outs[i].append(out.logits)

    for i, run in enumerate(alone):
        assert torch.equal(torch.cat(outs[i]), run.logits)
        assert kv_bytes(pools, batched[i][0]) == kv_bytes(pools, run.slots)
        assert state_bytes(pools, batched[i][1]) == state_bytes(pools, run.mamba_slot)


def test_the_thread_count_does_not_change_a_bit():
    model, pools = build("hybrid", 16, 40)
    tokens = random_tokens(80, seed=30)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_chunks(model, pools, tokens, [64, 16])
        torch.set_num_threads(2)
        two = run_chunks(model, pools, tokens, [16, 64])
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one.logits, two.logits)


# -- Mamba snapshots at page boundaries ----------------------------------------------------


def test_page_boundaries_are_the_aligned_lengths_inside_a_chunk():
    assert page_boundaries(8, 40, 8) == (16, 24, 32, 40)
    assert page_boundaries(5, 30, 8) == (8, 16, 24)
    assert page_boundaries(16, 17, 16) == ()
    assert page_boundaries(3, 4, 1) == (4,)


def test_snapshots_inside_a_chunk_equal_the_state_of_chunks_ending_there():
    page_size = 8
    model, pools = build("full+mamba", page_size, None)
    tokens = random_tokens(40, seed=40)
    slots, slot = alloc_sequence(pools, 40)
    run_chunks(model, pools, tokens[:8], [8], slots[:8], slot)
    boundaries = page_boundaries(8, 40, page_size)
    chunk = SequenceChunk(tokens[8:40], torch.arange(8, 40), slots, slot, boundaries)
    out = model.forward_batch(pools, [chunk])[0]
    assert tuple(sorted(out.mamba_snapshots)) == boundaries
    final = state_bytes(pools, slot)

    for boundary in boundaries:
        run = run_chunks(model, pools, tokens[:boundary], [boundary])
        expected = state_bytes(pools, run.mamba_slot)
        out.mamba_snapshots[boundary].write_to(pools, run.mamba_slot)
        assert state_bytes(pools, run.mamba_slot) == expected
    assert state_bytes(pools, slot) == final

    # Resuming from a snapshot continues exactly like the one-pass run.
    reference = run_chunks(model, pools, tokens, [40])
    resumed_slots, resumed_slot = alloc_sequence(pools, 40)
    pools.full.buffer[:, :, torch.as_tensor(resumed_slots)] = pools.full.buffer[
        :, :, torch.as_tensor(slots)
    ]
    out.mamba_snapshots[24].write_to(pools, resumed_slot)
    resumed = run_chunks(model, pools, tokens, [16], resumed_slots, resumed_slot, start=24)
    assert torch.equal(resumed.logits, reference.logits[24:])


# -- what attention reads ------------------------------------------------------------------


def test_sliding_window_attends_to_exactly_the_last_window_tokens():
    window = 6
    model, pools = build("full+swa", 4, window)
    tokens = random_tokens(20, seed=50)
    run = run_chunks(model, pools, tokens, [20])
    t = 19
    swa = torch.as_tensor(pools.swa_slots_of(run.slots))

    def logits_of_last() -> torch.Tensor:
        return model.forward(pools, tokens[t:], [t], run.slots, None)[0]

    assert torch.equal(logits_of_last(), run.logits[t])  # recomputing is idempotent
    pools.swa.buffer[:, :, swa[t - window]] = 7.0  # just outside the window
    assert torch.equal(logits_of_last(), run.logits[t])
    pools.swa.buffer[:, :, swa[t - window + 1]] = 7.0  # the oldest token inside it
    assert not torch.equal(logits_of_last(), run.logits[t])


def test_attention_reads_earlier_kv_from_the_pool():
    model, pools = build("full", 4, None)
    tokens = random_tokens(12, seed=51)
    run = run_chunks(model, pools, tokens, [12])
    pools.full.buffer[1, 0, int(run.slots[0])] += 1.0  # V of token 0, first layer
    again = model.forward(pools, tokens[11:], [11], run.slots, None)
    assert not torch.equal(again, run.logits[11])


def test_models_with_equal_seeds_agree_and_other_seeds_differ():
    spec = tiny_hybrid(KINDS["hybrid"], page_size=4, sliding_window=6, full_slots=512)
    tokens = random_tokens(9, seed=52)
    results = []
    for seed in (0, 0, 1):
        config = ModelConfig(sliding_window=6, seed=seed)
        model = HybridModel(spec.layout, config)
        pools = DevicePools.allocate(spec.layout, spec.cache_config)
        results.append(run_chunks(model, pools, tokens, [9]).logits)
    assert torch.equal(results[0], results[1])
    assert not torch.equal(results[0], results[2])


# -- the cache-less reference runner -------------------------------------------------------


def test_generate_is_greedy_chunk_size_invariant_and_frees_everything():
    model, pools = build("hybrid", 16, 40)
    before = pools.free_counts()
    prompt = random_tokens(70, seed=60)
    result = generate(model, pools, prompt, 12, prefill_chunk_tokens=64)
    assert pools.free_counts() == before
    assert len(result.token_ids) == 12 and result.logits.shape == (12, 256)
    assert result.token_ids == result.logits.argmax(dim=-1).tolist()
    assert len(set(result.token_ids)) > 1

    for chunk_tokens in (16, 32, 128):
        other = generate(model, pools, prompt, 12, prefill_chunk_tokens=chunk_tokens)
        assert other.token_ids == result.token_ids
        assert torch.equal(other.logits, result.logits)

    # The same as feeding prompt + generated tokens token by token.
    sequence = torch.cat([prompt, torch.tensor(result.token_ids[:-1])])
    run = run_chunks(model, pools, sequence, [1] * sequence.numel())
    assert torch.equal(run.logits[69:], result.logits)


def test_generate_frees_its_slots_when_the_pool_runs_out():
    spec = tiny_hybrid(KINDS["hybrid"], page_size=16, sliding_window=20, full_slots=64)
    model, pools = spec.build()
    before = pools.free_counts()
    with pytest.raises(PoolExhaustedError):
        generate(model, pools, random_tokens(40, seed=61), 40)
    assert pools.free_counts() == before


def test_generate_rejects_chunks_that_do_not_end_on_page_boundaries():
    model, pools = build("full", 16, None)
    with pytest.raises(ValueError, match="multiple of the page size"):
        generate(model, pools, [1, 2, 3], 2, prefill_chunk_tokens=24)


# -- bad input -----------------------------------------------------------------------------


def test_bad_forward_input_is_rejected_with_a_clear_error():
    model, pools = build("hybrid", 4, 6)
    slots, slot = alloc_sequence(pools, 8)
    tokens = random_tokens(8, seed=70)
    with pytest.raises(ValueError, match=r"positions must be 4\.\.7"):
        model.forward(pools, tokens[4:], [5, 6, 7, 8], slots, slot)
    with pytest.raises(ValueError, match="Mamba"):
        model.forward(pools, tokens, torch.arange(8), slots, None)
    with pytest.raises(ValueError, match="token ids"):
        model.forward(pools, [300], [0], slots[:1], slot)
    with pytest.raises(ValueError, match="share a Mamba slot"):
        model.forward_batch(
            pools,
            [
                SequenceChunk(tokens[:1], [0], slots[:1], slot),
                SequenceChunk(tokens[:1], [0], slots[4:5], slot),
            ],
        )


def test_a_freed_swa_page_inside_the_window_is_an_error():
    model, pools = build("full+swa", 4, 6)
    tokens = random_tokens(12, seed=71)
    run = run_chunks(model, pools, tokens[:8], [8])
    slots = np.concatenate([run.slots, pools.full.pages_to_slots(pools.alloc_kv_pages(1))])
    pools.free_swa_of(np.array([slots[4] // 4]))  # tokens 4-7: inside the window of 8
    with pytest.raises(ValueError, match="inside the sliding window"):
        model.forward(pools, tokens[8:9], [8], slots[:9], None)


def test_pools_of_another_layout_or_window_are_rejected():
    model, _ = build("hybrid", 4, 6)
    other = tiny_hybrid(KINDS["full"], page_size=4, full_slots=256)
    with pytest.raises(ConfigError, match="another layout"):
        model.forward(DevicePools.allocate(other.layout, other.cache_config), [1], [0], [0], 0)
    config = CacheConfig(page_size=4, sliding_window=9, full_slots=256, mamba_slots=4)
    with pytest.raises(ConfigError, match="sliding_window"):
        model.forward(DevicePools.allocate(model.layout, config), [1], [0], [0], 0)


def test_inconsistent_model_dimensions_are_config_errors():
    layout = ModelLayout(
        ("full", "mamba"),
        num_kv_heads=2,
        head_dim=8,
        conv_dim=6,
        conv_kernel=4,
        ssm_state_shape=(2, 3, 4),
    )
    with pytest.raises(ConfigError, match="conv_dim must be"):
        HybridModel(layout)
    with pytest.raises(ConfigError, match="sliding_window"):
        HybridModel(tiny_hybrid_layout(("full", "swa")), ModelConfig())
    with pytest.raises(ConfigError, match="max_positions"):
        HybridModel(tiny_hybrid_layout(("full",)), ModelConfig(max_positions=10**6))


# -- under the device-tier cache -----------------------------------------------------------


def test_requests_served_from_the_device_cache_give_the_cache_less_logits():
    """Prefill in page-aligned chunks with Mamba checkpoints at chunk ends, decode, cache;
    later requests that share the prompt's head hit it and must match generate()."""
    page_size, chunk = 16, 32
    model, pools = build("hybrid", page_size, 24)
    cache = UnifiedRadixCache(model.layout, pools.config, pools)
    shared = random_tokens(100, seed=80).tolist()

    def serve(rid: int, prompt: list[int], new_tokens: int) -> tuple[int, torch.Tensor]:
        req = Request(rid=rid)
        hit = cache.match_prefix(prompt, req=req).prefix_len
        logits, start, sequence = [], hit, list(prompt)
        while len(logits) < new_tokens:
            end = min(start + chunk, len(prompt)) if start < len(prompt) else start + 1
            if start >= len(prompt):
                sequence.append(int(logits[-1].argmax()))
            cache.alloc_tokens(req, end - start)
            out = model.forward(
                pools, sequence[start:end], range(start, end), req.kv_slots[:end], req.mamba_slot
            )
            req.append_tokens(sequence[start:end])
            if end % page_size == 0:
                cache.checkpoint_mamba(req)
            cache.release_swa_outside_window(req)
            if end <= len(prompt):
                cache.cache_unfinished_req(req)
            if end >= len(prompt):
                logits.append(out[-1])
            start = end
        cache.cache_finished_req(req)
        cache.check_invariants()
        return hit, torch.stack(logits)

    for rid in range(3):
        prompt = shared + random_tokens(20 + rid, seed=81 + rid).tolist()
        hit, logits = serve(rid, prompt, 6)
        assert hit == (0 if rid == 0 else 96)  # the last chunk end with a Mamba state
        expected = generate(model, pools, prompt, 6, prefill_chunk_tokens=chunk)
        assert torch.equal(logits, expected.logits)
