"""The wire vocabulary and the pool sharing functions, without a server."""

from __future__ import annotations

import dataclasses
from multiprocessing import shared_memory

import numpy as np
import pytest
import torch

from hicache import CacheConfig, DevicePools
from hicache.controller.client.device_share import export_pools
from hicache.controller.sidecar.device_map import RegistrationRefused, map_pools
from hicache.controller.wire.fields import decode_keys, decode_refs, encode_keys, encode_refs
from hicache.controller.wire.protocol import (
    ErrorCode,
    ProtocolError,
    Verb,
    decode_request,
    encode_request,
    normalize_endpoint,
    pack,
)
from hicache.controller.wire.verbs import SPECS
from hicache.controller_api import PageRef
from hicache.engine_keys import EngineKey, pack_engine_key
from hicache.types import ComponentType, HicacheError
from tests.support.cache import make_layout

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA


def _refs(n: int) -> list[PageRef]:
    comps = [FULL, SWA, MAMBA]
    return [PageRef(comps[i % 3], bytes([i]) * 16, bytes([255 - i]) * 16, i * 7) for i in range(n)]


def test_refs_and_keys_round_trip_as_columns():
    refs = _refs(10)
    assert decode_refs(encode_refs(refs)) == refs
    keys = [r.key for r in refs]
    assert decode_keys(encode_keys(keys)) == keys
    engine_keys = [pack_engine_key(EngineKey(bytes([i]) * 32, 0, "full", 16)) for i in range(10)]
    named = [dataclasses.replace(r, engine_key=k) for r, k in zip(refs, engine_keys)]
    assert decode_refs(encode_refs(named)) == named


def test_refs_and_keys_decoded_are_what_their_constructors_make():
    """The decoders build refs and keys past the dataclass's ``__init__`` (per page, on
    the sidecar's path): equal, hashing equal, and as immutable as constructed ones."""
    refs = _refs(6)
    decoded, keys = decode_refs(encode_refs(refs)), decode_keys(encode_keys([r.key for r in refs]))
    for ref, mine, key in zip(refs, decoded, keys):
        assert type(mine) is PageRef and repr(mine) == repr(ref) and hash(mine) == hash(ref)
        assert key == ref.key and hash(key) == hash(ref.key) and {key: 1}[ref.key] == 1
        with pytest.raises(dataclasses.FrozenInstanceError):
            mine.device_index = 0
        with pytest.raises(dataclasses.FrozenInstanceError):
            key.page_hash = b"\0" * 16
    assert dataclasses.replace(decoded[0], device_index=99).device_index == 99


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda c: {**c, "h": c["h"][:-1]}, "multiple of 16"),
        (lambda c: {**c, "d": c["d"][:8]}, "expected 10"),
        (lambda c: {**c, "c": b"\x07" * 10}, "unknown component"),
        (lambda c: {**c, "d": np.full(10, -1, "<i8").tobytes()}, ">= 0"),
        (lambda c: {k: v for k, v in c.items() if k != "p"}, "columns c, h, p and d"),
    ],
)
def test_bad_ref_columns_are_refused_with_the_reason(mutate, words):
    with pytest.raises(ProtocolError) as e:
        decode_refs(mutate(encode_refs(_refs(10))))
    assert e.value.code is ErrorCode.BAD_ARGS and words in e.value.message


def test_request_round_trip_and_error_codes():
    req = decode_request(encode_request(42, Verb.LOOKUP, {"x": b"y"}, 0.25), 1 << 20)
    assert (req.id, req.verb, req.ttl_s, req.args) == (42, Verb.LOOKUP, 0.25, {"x": b"y"})
    with pytest.raises(ProtocolError) as e:
        decode_request(b"\x00" * 100, 64)
    assert e.value.code is ErrorCode.TOO_LARGE
    with pytest.raises(ProtocolError) as e:
        decode_request(pack({"v": 1, "id": 3, "verb": "nope", "ttl_ms": 5, "args": {}}), 1 << 20)
    assert e.value.code is ErrorCode.UNKNOWN_VERB and "lookup" in e.value.message
    assert e.value.request_id == 3  # the error reply can name the request
    with pytest.raises(ProtocolError) as e:
        decode_request(pack({"v": 1, "id": True, "verb": "health"}), 1 << 20)
    assert e.value.code is ErrorCode.BAD_MESSAGE


def test_args_refuse_bools_for_ints_and_unknown_names():
    with pytest.raises(ProtocolError, match="integer"):
        SPECS[Verb.UNPIN].decode_args({"pin_id": True})
    with pytest.raises(ProtocolError, match="unknown argument"):
        SPECS[Verb.UNPIN].decode_args({"pin_id": 1, "extra": 2})


def test_endpoints():
    assert normalize_endpoint("tcp://h:1") == "tcp://h:1"
    assert normalize_endpoint("/run/x.sock") == "ipc:///run/x.sock"
    with pytest.raises(HicacheError, match="only ipc:// and tcp://"):
        normalize_endpoint("http://h")


def _shared_pools(mix: str = "full+swa+mamba", heads: int | None = None) -> DevicePools:
    layout = make_layout(mix)
    if heads is not None:
        d = layout.to_dict()
        d["num_kv_heads"] = heads
        layout = type(layout).from_dict(d)
    cfg = CacheConfig(
        page_size=4, sliding_window=8, full_slots=64, mamba_slots=4, shared_memory=True
    )
    return DevicePools.allocate(layout, cfg)


def test_shared_memory_pools_map_onto_the_same_bytes():
    pools = _shared_pools()
    try:
        mapped = map_pools(pools.layout, 4, export_pools(pools))
        pools.full.buffer[1, 0, 5] = 3.5
        pools.mamba.ssm[0, 2] = 7.0
        assert torch.equal(mapped.buffers.full_kv, pools.full.buffer)
        assert torch.equal(mapped.buffers.mamba_ssm, pools.mamba.ssm)
        mapped.buffers.swa_kv[0, 0, 1] = 9.0  # and writes go the other way
        assert torch.all(pools.swa.buffer[0, 0, 1] == 9.0)
        mapped.buffers = None
        assert mapped.close()
    finally:
        pools.close()


def test_mapped_pools_stay_mapped_while_a_tensor_of_them_lives():
    """The sidecar unmaps an engine's memory only once nothing can touch it: a copy that
    still holds a view (here a slice of the K pool) keeps the segments mapped, and close()
    says so; once the view is gone, close() unmaps."""
    pools = _shared_pools()
    try:
        mapped = map_pools(pools.layout, 4, export_pools(pools))
        view = mapped.buffers.full_kv[0, 0, 4:8]
        mapped.buffers = None
        assert not mapped.close()
        pools.full.buffer[0, 0, 5] = 2.5
        assert torch.all(view[1] == 2.5)  # still the engine's bytes, still mapped
        del view
        assert mapped.close()
        assert not mapped.segments
    finally:
        pools.close()


def test_pools_of_another_shape_are_refused():
    pools = _shared_pools(heads=3)
    try:
        with pytest.raises(RegistrationRefused, match="buffer 'full' is"):
            map_pools(make_layout("full+swa+mamba"), 4, export_pools(pools))
    finally:
        pools.close()


@pytest.mark.parametrize("what", ["wrong key", "no key", "another program's segment"])
def test_a_segment_is_mapped_only_with_the_key_it_holds(what):
    """Shared memory is mapped only for a client that can read it: the key after the
    tensor must be the one sent. A wrong or missing key, or a segment that is not an
    engine pool (no key in it), is refused, nothing stays mapped, and its bytes are
    untouched."""
    pools = _shared_pools("full")
    size = pools.full.buffer.numel() * pools.full.buffer.element_size() + 16
    foreign = shared_memory.SharedMemory(create=True, size=size)  # as large as the pool's
    try:
        foreign.buf[:] = np.random.default_rng(0).bytes(size)
        before = bytes(foreign.buf)
        desc = export_pools(pools)
        full = desc["buffers"]["full"]
        if what == "wrong key":
            full["key"] = bytes(15) + b"\x01"  # not the key (an all-zero one: see below)
        elif what == "no key":
            del full["key"]
        else:
            full["shm_name"] = foreign.name
        message = "'key' must be" if what == "no key" else "does not hold the key"
        with pytest.raises(RegistrationRefused, match=message):
            map_pools(pools.layout, 4, desc)
        assert bytes(foreign.buf) == before
        desc = export_pools(pools)  # the engine's own key maps it
        mapped = map_pools(pools.layout, 4, desc)
        mapped.buffers = None
        assert mapped.close()
    finally:
        foreign.close()
        foreign.unlink()
        pools.close()


def test_private_cpu_pools_cannot_be_exported():
    layout = make_layout("full")
    pools = DevicePools.allocate(layout, CacheConfig(page_size=4, full_slots=64))
    with pytest.raises(HicacheError, match="shared_memory=True"):
        export_pools(pools)


@pytest.mark.parametrize(
    ("shape", "stride", "ok"),
    [
        ([2, 3, 8, 2, 4], [192, 64, 8, 4, 1], True),  # dense
        ([2, 3, 8, 2, 4], [256, 64, 8, 4, 1], True),  # padded between K and V
        ([2, 3, 8, 2, 4], [0, 64, 8, 4, 1], False),  # K and V one memory
        ([2, 3, 8, 2, 4], [192, 8, 8, 4, 1], False),  # layers overlap slots
        ([1, 3, 1, 4], [0, 4, 0, 1], True),  # size-1 dims may have any stride
    ],
)
def test_a_cuda_registration_whose_strides_overlap_is_refused(shape, stride, ok):
    """Checked before the IPC handle is opened (no GPU needed): a zero or overlapping
    stride would make every copy into one K/V half, layer or slot land in another."""
    from hicache.controller.sidecar.device_map import _map_cuda

    desc = {
        "kind": "cuda_ipc",
        "device_uuid": "GPU-none",
        "handle": b"x",
        "storage_bytes": 1 << 20,
        "storage_offset_bytes": 0,
        "ref_counter_handle": b"x",
        "ref_counter_offset": 0,
        "event_handle": b"",
        "event_sync_required": False,
        "dtype": "float32",
        "shape": shape,
        "stride": stride,
        "offset": 0,
    }
    with pytest.raises(RegistrationRefused) as err:
        _map_cuda(desc, [])
    assert ("overlap" in str(err.value)) is not ok, str(err.value)
