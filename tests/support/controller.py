"""Shared setup of the controller tests: a hybrid layout, engines with marked device
pages, and the page references that address them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hicache import CacheConfig, ComponentType, DevicePools, ModelLayout
from hicache.controller.config import ControllerConfig
from hicache.controller.store.local import LocalController
from hicache.controller_api import PageKey, PageRef
from hicache.keys import namespace_hash, page_hashes

PAGE = 4
FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA
ALL = (FULL, SWA, MAMBA)


def hybrid_layout(head_dim: int = 8) -> ModelLayout:
    return ModelLayout(
        ("full", "swa", "mamba", "full"),
        num_kv_heads=2,
        head_dim=head_dim,
        conv_dim=6,
        conv_kernel=4,
        ssm_state_shape=(2, 3, 4),
    )


def controller_config(tmp_path, **overrides) -> ControllerConfig:
    """A small controller over a real LMDB environment under ``tmp_path``."""
    kw = dict(
        host_pool_bytes=1 << 20,
        disk_path=tmp_path / "lmdb",
        disk_budget_bytes=8 << 20,
        disk_sync=False,
        reader_threads=2,
        writer_flush_interval_s=0.0,
    )
    kw.update(overrides)
    return ControllerConfig(**kw)


def _random_like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random bytes shaped and typed like ``t`` (any dtype: the bits are random)."""
    raw = torch.randint(0, 256, (*t.shape, t.element_size()), dtype=torch.uint8, generator=gen)
    return raw.view(t.dtype).squeeze(-1)


@dataclass
class Chain:
    """One cached prefix as an engine holds it: hashes and the device places of its pages."""

    hashes: list[bytes]
    parents: list[bytes]
    full_pages: list[int]
    swa_pages: list[int]
    mamba_slots: dict[int, int] = field(default_factory=dict)  # page index -> state slot

    def refs(self, components=ALL) -> list[PageRef]:
        out = []
        for i, (h, p) in enumerate(zip(self.hashes, self.parents)):
            if FULL in components:
                out.append(PageRef(FULL, h, p, self.full_pages[i]))
            if SWA in components and self.swa_pages:
                out.append(PageRef(SWA, h, p, self.swa_pages[i]))
            if MAMBA in components and i in self.mamba_slots:
                out.append(PageRef(MAMBA, h, p, self.mamba_slots[i]))
        return out

    def page_keys(self, components=ALL) -> list[PageKey]:
        return [r.key for r in self.refs(components)]


class Engine:
    """An engine's device pools, filled with recognisable random bytes per page."""

    def __init__(
        self, layout: ModelLayout, full_slots: int = 1024, mamba_slots: int = 128, seed: int = 0
    ) -> None:
        self.layout = layout
        cfg = CacheConfig(
            page_size=PAGE, sliding_window=8, full_slots=full_slots, mamba_slots=mamba_slots
        )
        self.pools = DevicePools.allocate(layout, cfg)
        self.gen = torch.Generator().manual_seed(seed)
        self.fingerprint = layout.fingerprint(PAGE)

    def write_chain(self, tokens, extra_key: str | None = None, mamba_every: int = 1) -> Chain:
        """Allocate device pages for ``tokens`` and fill them (and states) with markers."""
        hashes = page_hashes(tokens, self.fingerprint, PAGE, extra_key)
        parents = [namespace_hash(self.fingerprint, extra_key), *hashes[:-1]]
        n = len(hashes)
        mamba_at = [i for i in range(n) if (i + 1) % mamba_every == 0 or i == n - 1]
        chain = self.place(hashes, parents, mamba_at)
        self.scribble(chain)
        return chain

    def place(self, hashes, parents, mamba_at=()) -> Chain:
        """Fresh device pages, and state slots at page indices ``mamba_at``; contents
        unspecified."""
        pages = self.pools.alloc_kv_pages(len(hashes))
        swa = [int(self.pools.full_to_swa[p]) for p in pages] if self.pools.swa else []
        chain = Chain(list(hashes), list(parents), [int(p) for p in pages], swa)
        if self.pools.mamba is not None:
            for i in mamba_at:
                chain.mamba_slots[i] = self.pools.mamba.alloc_state()
        return chain

    def _regions(self, chain: Chain) -> dict[tuple[ComponentType, int], list[torch.Tensor]]:
        """Views of the device bytes of each (component, page index) of ``chain``."""
        out: dict[tuple[ComponentType, int], list[torch.Tensor]] = {}
        for i, p in enumerate(chain.full_pages):
            out[FULL, i] = [self.pools.full.buffer[:, :, p * PAGE : (p + 1) * PAGE]]
        for i, p in enumerate(chain.swa_pages):
            out[SWA, i] = [self.pools.swa.buffer[:, :, p * PAGE : (p + 1) * PAGE]]
        for i, slot in chain.mamba_slots.items():
            out[MAMBA, i] = [self.pools.mamba.conv[:, slot], self.pools.mamba.ssm[:, slot]]
        return out

    def scribble(self, chain: Chain) -> None:
        """Overwrite every device byte of ``chain`` with fresh random bytes."""
        for views in self._regions(chain).values():
            for v in views:
                v.copy_(_random_like(v, self.gen))

    def snapshot(self, chain: Chain) -> dict[tuple[ComponentType, int], bytes]:
        """The bytes of every page and state of ``chain``, by (component, page index)."""
        return {
            key: b"".join(v.contiguous().view(torch.uint8).cpu().numpy().tobytes() for v in views)
            for key, views in self._regions(chain).items()
        }


def assert_same_bytes(got: dict, want: dict) -> None:
    """Every region of ``got`` equals the same region of ``want``, byte for byte."""
    assert got.keys() <= want.keys()
    for key in got:
        assert got[key] == want[key], f"{key[0].name} page {key[1]} differs"


def load_into(
    ctl: LocalController, engine: Engine, chain: Chain, components=ALL, only=None, **kw
) -> Chain:
    """Pin and load ``chain``'s pages (those of ``components``, or the keys in ``only``)
    into fresh device places of ``engine``; returns those places.

    Raises AssertionError when the pin or the load fails.
    """
    target = engine.place(chain.hashes, chain.parents, sorted(chain.mamba_slots))
    engine.scribble(target)
    refs = target.refs(components)
    if only is not None:
        refs = [r for r in refs if r.key in only]
    pin = ctl.pin([r.key for r in refs], 30.0, **kw)
    assert pin is not None, "pin found a page absent"
    try:
        assert ctl.load(refs, pin, 10.0, **kw), "load failed"
    finally:
        ctl.unpin(pin, **kw)
    return target


def registered_controller(tmp_path, **overrides) -> tuple[ModelLayout, Engine, LocalController]:
    """A controller (``controller_config`` with ``overrides``) and a hybrid-layout engine
    registered with it."""
    layout = hybrid_layout()
    engine = Engine(layout)
    ctl = LocalController(controller_config(tmp_path, **overrides))
    ctl.register(layout, PAGE, engine.pools)
    return layout, engine, ctl


def stored_then_restarted(tmp_path, pages: int, **overrides):
    """A hybrid-layout engine's chain of ``pages`` pages (every component, a Mamba state
    every third page) stored through a controller (``controller_config`` with
    ``overrides``), then a restart on the same LMDB: every page on disk only. Returns
    (engine, controller, chain, the chain's bytes)."""
    layout = hybrid_layout()
    engine = Engine(layout)
    ctl = LocalController(controller_config(tmp_path, **overrides))
    ctl.register(layout, PAGE, engine.pools)
    chain = engine.write_chain(range(pages * PAGE), mamba_every=3)
    snap = engine.snapshot(chain)
    assert ctl.backup(chain.refs()).wait(10.0)
    ctl.close()
    ctl = LocalController(controller_config(tmp_path, **overrides))
    ctl.register(layout, PAGE, engine.pools)
    return engine, ctl, chain, snap
