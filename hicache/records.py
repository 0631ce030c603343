"""Small records the cache hands out: requests, match, evict and lock results."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hicache.keys import TokenInput, token_array
from hicache.types import ComponentType

if TYPE_CHECKING:
    from hicache.node import TreeNode

_EMPTY = np.zeros(0, dtype=np.int64)
_receipt_ids = itertools.count(1)


@dataclass
class LockReceipt:
    """What one ``lock`` took, so that ``unlock`` gives back exactly that.

    ``parts`` holds each component's own record, by component index: FULL locked ``node``
    to the root; SWA records the token position where its window lock stopped (the
    boundary), MAMBA whether it locked ``node``'s state.
    """

    node: TreeNode
    parts: dict[int, Any] = field(default_factory=dict)
    receipt_id: int = field(default_factory=lambda: next(_receipt_ids))
    released: bool = False


class Request:
    """The cache's record of what one engine request holds.

    ``kv_slots`` are the FULL slots of the request's tokens in order: the first
    ``prefix_len`` belong to the tree (locked by ``lock_receipt``), the rest to the request.
    ``token_ids`` are the tokens whose KV (and state) the engine has computed.
    ``mamba_slot`` is the request's own working state; ``mamba_ckpt_slot`` a copy of it
    taken when ``mamba_ckpt_len`` tokens were computed (always page aligned).
    """

    def __init__(self, rid: str | int = "", extra_key: str | None = None) -> None:
        self.rid = rid
        self.extra_key = extra_key
        self.token_ids: np.ndarray = _EMPTY
        self.kv_slots: np.ndarray = _EMPTY
        self.prefix_len = 0
        self.last_node: TreeNode | None = None
        self.lock_receipt: LockReceipt | None = None
        self.mamba_slot: int | None = None
        self.mamba_ckpt_slot: int | None = None
        self.mamba_ckpt_len = 0
        self.swa_released_upto = 0
        self.finished = False

    @property
    def computed_len(self) -> int:
        return int(self.token_ids.size)

    def append_tokens(self, token_ids: TokenInput) -> None:
        """Record tokens whose KV (and Mamba state) the engine has just computed."""
        new = token_array(token_ids)
        if self.token_ids.size + new.size > self.kv_slots.size:
            raise ValueError(
                f"request {self.rid}: {self.token_ids.size + new.size} tokens computed but only "
                f"{self.kv_slots.size} slots allocated; call cache.alloc_tokens first"
            )
        self.token_ids = (
            np.concatenate([self.token_ids, new]) if self.token_ids.size else new.copy()
        )

    def __repr__(self) -> str:
        return (
            f"Request(rid={self.rid!r}, computed={self.computed_len}, slots={self.kv_slots.size}, "
            f"prefix_len={self.prefix_len}, mamba_slot={self.mamba_slot})"
        )


@dataclass
class MatchResult:
    """The outcome of ``match_prefix``.

    ``device_slots`` (numpy) / ``device_indices`` (the same as a torch tensor) are the FULL
    slots of the first ``prefix_len`` tokens, usable now; they are the caller's copy.
    ``host_hit_len`` tokens after them can be loaded from the host tier, and
    ``disk_hit_len`` tokens after those from disk, ``remote_hit_len`` after those from the
    remote tier (read into host by the load's pin); ``load_node`` is where ``load_back``
    would end (None when there is nothing to load).
    """

    device_slots: np.ndarray
    prefix_len: int
    last_node: TreeNode
    host_hit_len: int = 0
    disk_hit_len: int = 0
    remote_hit_len: int = 0
    load_node: TreeNode | None = None
    mamba_slot: int | None = None

    @property
    def device_indices(self) -> torch.Tensor:
        """``device_slots`` as an int64 tensor (sharing memory with it)."""
        return torch.from_numpy(self.device_slots)

    @property
    def total_hit_len(self) -> int:
        return self.prefix_len + self.host_hit_len + self.disk_hit_len + self.remote_hit_len


class EvictResult:
    """What an eviction actually freed on the device, per component: ``amounts`` maps a
    component type to tokens (FULL, SWA) or states (MAMBA). ``full_tokens``,
    ``swa_tokens`` and ``mamba_states`` read it for the three shipped components."""

    __slots__ = ("amounts",)

    def __init__(self, amounts: Mapping[ComponentType, int] | None = None) -> None:
        self.amounts: dict[ComponentType, int] = dict(amounts or {})

    def add(self, component: ComponentType, amount: int) -> None:
        self.amounts[component] = self.amounts.get(component, 0) + amount

    def get(self, component: ComponentType) -> int:
        return self.amounts.get(component, 0)

    @staticmethod
    def named(
        full_tokens: int = 0, swa_tokens: int = 0, mamba_states: int = 0
    ) -> dict[ComponentType, int]:
        """The three shipped components' amounts as a mapping (zeros left out)."""
        named = {
            ComponentType.FULL: full_tokens,
            ComponentType.SWA: swa_tokens,
            ComponentType.MAMBA: mamba_states,
        }
        return {c: n for c, n in named.items() if n}

    def merge(self, other: EvictResult) -> None:
        """Add every amount of ``other`` to this one (running totals)."""
        for component, amount in other.amounts.items():
            self.add(component, amount)

    @property
    def full_tokens(self) -> int:
        return self.get(ComponentType.FULL)

    @property
    def swa_tokens(self) -> int:
        return self.get(ComponentType.SWA)

    @property
    def mamba_states(self) -> int:
        return self.get(ComponentType.MAMBA)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EvictResult):
            return NotImplemented
        return {k: v for k, v in self.amounts.items() if v} == {
            k: v for k, v in other.amounts.items() if v
        }

    def __repr__(self) -> str:
        inner = ", ".join(f"{c.name}={n}" for c, n in sorted(self.amounts.items()))
        return f"EvictResult({inner})"


@dataclass
class CacheStats:
    """Evictable and protected device amounts per component (tokens; states for MAMBA),
    the tokens cached on the device, and running counters."""

    evictable: dict[ComponentType, int]
    protected: dict[ComponentType, int]
    total_tokens: int
    host_only_tokens: int
    num_nodes: int
    counters: dict[str, int]
    # Slots of failed load-backs whose copy may still write into them (see
    # ``UnifiedRadixCache.poll_transfers``): pages of every pool, states for MAMBA.
    quarantined_pages: int = 0
