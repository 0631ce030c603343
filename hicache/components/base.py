"""The TreeComponent protocol: what each kind of cached state answers for the tree.

The tree never asks which component it holds; it asks each component the same questions:
does a match may end here, what does a lock cover, what happens on a split, what does an
eviction free, what does a backup or a load-back move.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from hicache.controller_api import PageKey, PageRef
from hicache.types import ComponentType

if TYPE_CHECKING:
    from hicache.config import CacheConfig
    from hicache.node import ComponentData, TreeNode
    from hicache.pools import DevicePools
    from hicache.records import MatchResult, Request

# A predicate over (index into the match path, candidate end in tokens).
MatchCheck = Callable[[int, int], bool]
# Evicts until the pools hold the asked free amounts (per component type, in its units).
MakeRoom = Callable[[Mapping[ComponentType, int]], None]

_NONE = np.zeros(0, dtype=np.int64)


class TreeAccess(Protocol):
    """What a component asks of the tree that carries it (the radix tree implements it)."""

    def set_value(self, node: TreeNode, comp: TreeComponent, value: Any) -> None: ...

    def inc_lock(self, node: TreeNode, comp: TreeComponent) -> None: ...

    def dec_lock(self, node: TreeNode, comp: TreeComponent) -> None: ...

    def node_hashes(self, node: TreeNode) -> list[bytes]: ...

    def parent_hash(self, node: TreeNode) -> bytes: ...


@dataclass
class LoadPlan:
    """One load-back: bring the prefix ending at ``end_node`` to the device.

    ``base_node`` is the deepest node whose FULL the caller already holds on the device
    (locked); ``nodes`` are the nodes below it down to ``end_node``. Each component keeps
    its own part of the plan in ``parts`` (by component index).
    """

    base_node: TreeNode
    nodes: list[TreeNode]
    end_node: TreeNode
    parts: dict[int, Any] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.end_node.end


@dataclass
class LoadPrep:
    """What one component allocated for a load: the pages to fill, and its own record."""

    refs: list[PageRef]
    allocated: Any = None


@dataclass
class PendingView:
    """Where a load-back in flight puts what it loads, before it installs it: for an
    engine that reads the loaded layers while later ones still arrive (a layer-wise load).

    ``full_slots``: the FULL token slots of the loaded nodes, in order (those whose FULL
    is on the device already, their own); ``swa_pages``: the SWA page of each FULL page
    the load brings SWA KV for; ``state_slot``: the slot holding the Mamba state at the
    prefix's end (None without Mamba layers). Read it as ``pools.full_to_swa`` overlaid
    with ``swa_pages`` and the request's slots followed by ``full_slots``.
    """

    full_slots: list[np.ndarray] = field(default_factory=list)
    swa_pages: dict[int, int] = field(default_factory=dict)
    state_slot: int | None = None
    node_full_pages: dict[int, np.ndarray] = field(default_factory=dict)  # by node id


class TreeComponent(ABC):
    """One kind of cached state; one instance per cache, index ``idx`` into ``node.data``."""

    ctype: ComponentType
    #: Eviction priority on internal nodes: evicting a component also evicts every
    #: component of equal or lower priority on that node.
    priority: int
    #: Only device leaves may lose this component (FULL); others can go from any node.
    leaf_only: bool = False
    #: The head of a node cut by eviction can still end a match (False for a state kept
    #: only at a node's end: then eviction takes a leaf whole).
    head_survives_cut: bool = True

    def __init__(self, idx: int, tree: TreeAccess, pools: DevicePools, config: CacheConfig) -> None:
        self.idx = idx
        self.tree = tree
        self.pools = pools
        self.config = config
        self.page_size = config.page_size

    # -- values --------------------------------------------------------------------------

    @abstractmethod
    def size(self, value: Any) -> int:
        """Device amount held by ``value`` (tokens, or states for MAMBA)."""

    @abstractmethod
    def free(self, node: TreeNode, value: Any) -> int:
        """Return ``value`` (just taken off ``node``) to its pool; returns the amount."""

    @abstractmethod
    def owned_pages(self, node: TreeNode, value: Any) -> np.ndarray:
        """Pool page ids (or state slots) that ``value`` owns, for leak checks."""

    @abstractmethod
    def split(self, parent: ComponentData, child: ComponentData, k_tokens: int) -> None:
        """A node is cut after ``k_tokens``: move the prefix part of ``child`` (the old
        node, keeping the suffix) into the fresh ``parent`` (value, locks, backed flag)."""

    # -- match and locks -----------------------------------------------------------------

    def match_check(self, path: Sequence[TreeNode]) -> MatchCheck | None:
        """A predicate saying whether a match may end at a position on ``path`` (whose
        nodes all hold FULL on the device); None when every position is fine."""
        return None

    @abstractmethod
    def lock(self, node: TreeNode) -> Any:
        """Lock what a user of the prefix ending at ``node`` needs; returns the receipt part."""

    @abstractmethod
    def unlock(self, node: TreeNode, part: Any) -> None:
        """Undo exactly what ``lock`` took (``part`` is what it returned)."""

    # -- tiers ---------------------------------------------------------------------------

    @abstractmethod
    def backup_refs(self, node: TreeNode) -> list[PageRef]:
        """Pages of ``node`` to copy to the controller (empty when it holds none)."""

    def page_refs(self, node: TreeNode, device_indices: Sequence[int]) -> list[PageRef]:
        """One PageRef of this component per page of ``node``, chained by page hash."""
        hashes = self.tree.node_hashes(node)
        parents = [self.tree.parent_hash(node), *hashes[:-1]]
        return [
            PageRef(self.ctype, h, p, int(d))
            for h, p, d in zip(hashes, parents, device_indices, strict=True)
        ]

    def load_cut(self, end: int) -> int | None:
        """A token position where nodes on a load path must be cut (None: nowhere)."""
        return None

    @abstractmethod
    def plan_load(self, plan: LoadPlan) -> list[PageKey]:
        """Record in ``plan.parts`` what this component must load; return the page keys."""

    @abstractmethod
    def prepare_load_back(self, plan: LoadPlan, req: Request | None) -> LoadPrep:
        """Allocate the device slots the load needs. Raises PoolExhaustedError having
        allocated nothing when the pool is full; whatever it raises, it keeps nothing
        allocated (``finalize_load_back`` is called only for a prepare that returned)."""

    @abstractmethod
    def finalize_load_back(
        self, plan: LoadPlan, req: Request | None, prep: LoadPrep, ok: bool
    ) -> None:
        """On success install what was loaded; on failure free what ``prepare`` allocated
        and leave the request as it was (a slot it held before the call is kept)."""

    def pending_view(self, plan: LoadPlan, prep: LoadPrep, view: PendingView) -> None:
        """Record in ``view`` where this component's part of a load in flight lands (see
        :class:`PendingView`); called in component order, the backbone first. A
        component no engine reads from a load in flight records nothing."""
        return None

    def data(self, node: TreeNode) -> ComponentData:
        return node.data[self.idx]

    @abstractmethod
    def pool(self) -> Any:
        """The device pool (a page allocator) this component's values come from."""

    def available(self) -> int:
        """Free amount in this component's pool, in the units of ``size``."""
        return self.pool().available()

    def request_page_need(self, pages: int) -> int:
        """How much of this component ``pages`` new pages of a request take from its pool
        (in the units of ``size``): none unless the pools allocate it with them."""
        return 0

    def detach(self, node: TreeNode, value: Any) -> list[tuple[Any, np.ndarray]]:
        """Unhook ``value`` (just taken off ``node``) without returning it to its pool; the
        (allocator, pages) it held, which the caller frees later."""
        return [(self.pool(), self.owned_pages(node, value))]

    def load_targets(self, prep: LoadPrep) -> list[tuple[Any, np.ndarray]]:
        """(allocator, pages) that ``prepare`` allocated: what a failed load's copy may
        still write into, kept aside instead of freed until the copy has settled."""
        return [(self.pool(), np.asarray(prep.allocated, dtype=np.int64).reshape(-1))]

    # -- what a match beyond the device needs -----------------------------------------

    def mark_on_device(self, mask: np.ndarray, off: int, take: int, whole: bool) -> None:
        """A node holding this component on the device covers pages ``[off, off + take)``
        of a lookup (all of the node when ``whole``): mark the pages after which a match
        finds what it needs of this component on the device."""
        mask[off : off + take] = True

    def tiers_for_match_end(self, tiers: np.ndarray) -> np.ndarray:
        """From the tier of each page of this component (a ``Tier`` value, or
        ``ABSENT_RANK``) to, per page, the slowest tier a match ending after it needs of
        this component. By default every page up to the end."""
        return np.maximum.accumulate(tiers) if tiers.size else tiers

    def backed_by_lookup(self, present: np.ndarray) -> bool:
        """A node created from a lookup, whose pages of this component are ``present``
        (one bool per page): does the controller hold the node's value?"""
        return bool(np.all(present))

    # -- what a load-back needs --------------------------------------------------------

    def load_need(self, plan: LoadPlan) -> int:
        """Free amount this component's pool needs for the load (units of ``size``)."""
        return 0

    def hold_for_load(self, node: TreeNode) -> Any:
        """Hold what a load ending at ``node`` needs of this component beyond what the
        path's lock holds, until ``release_hold``; returns the record of it."""
        return None

    def release_hold(self, held: Any) -> None:  # noqa: B027 - optional hook
        """Undo ``hold_for_load``."""

    # -- what requests hold (the cache's request lifecycle) ---------------------------
    #
    # ``make_room`` arguments evict until the pools hold the asked free amounts; hooks that
    # allocate from a pool call it first.

    def attach_request(self, req: Request, result: MatchResult, make_room: MakeRoom) -> None:  # noqa: B027 - optional hook
        """``req`` was just given the matched prefix ending at ``result.last_node``: give it
        what it needs of this component of its own. Raises PoolExhaustedError having
        allocated nothing."""

    def checkpoint_request(self, req: Request, make_room: MakeRoom) -> None:  # noqa: B027 - optional hook
        """``req`` computed a page-aligned length: keep what caching there would need."""

    def release_outside_window(self, req: Request) -> int:
        """Free what ``req`` holds of this component that its next tokens no longer read;
        returns the amount freed."""
        return 0

    def request_insert_end(
        self, req: Request, end: int, finishing: bool, make_room: MakeRoom
    ) -> tuple[int, Any]:
        """Caching ``req`` up to ``end`` (page aligned): how far this component lets it go,
        and the value it hands to the node ending there (None: none). With ``finishing``
        the request gives its own value up; otherwise a copy is made."""
        return end, None

    def insert_valid_from(self, own_pages: np.ndarray, prev_prefix_len: int, n: int) -> int | None:
        """Of an insert of ``n`` tokens whose pages from ``prev_prefix_len`` on are
        ``own_pages`` (the request's backbone pages), the token position from which they
        carry this component (the insert cuts nodes there); None: no such position."""
        return None

    def fill_from_request(self, node: TreeNode, full_pages: np.ndarray, valid_from: Any) -> None:  # noqa: B027 - optional hook
        """``node`` was just given the request's backbone pages ``full_pages``: take this
        component's value from what the request holds with them (``valid_from`` is what
        ``insert_valid_from`` answered)."""

    def adopt_from_request(self, node: TreeNode, own_pages: np.ndarray) -> None:  # noqa: B027 - optional hook
        """A request inserts tokens ``node`` already holds on the device, with its own
        backbone pages ``own_pages`` (about to be freed): where ``node`` lacks this
        component and the request holds it, ``node`` takes the request's, which the
        request, going on with ``node``'s slots, still needs."""

    def take_end_value(self, node: TreeNode, value: Any) -> None:
        """An insert ending at ``node`` hands over ``value`` (see ``request_insert_end``):
        the node takes it, or it is freed when the node has one already."""
        raise NotImplementedError(f"{self} keeps no value at a node's end")

    def discard_value(self, value: Any) -> None:
        """Free a value handed over with nothing to give it to."""
        raise NotImplementedError(f"{self} keeps no value at a node's end")

    def return_request_value(self, req: Request) -> bool:
        """``req``, finishing with nothing computed past its prefix, gives its own value to
        the prefix's end node where that node has none; True when it did."""
        return False

    def request_cached(self, req: Request, end: int) -> None:  # noqa: B027 - optional hook
        """The cache now holds ``req``'s first ``end`` tokens as its prefix."""

    def release_request(self, req: Request) -> None:  # noqa: B027 - optional hook
        """``req`` finishes (or its attach failed): free what it holds of this component
        apart from its pages, which the pools free with their backbone pages."""

    # -- invariants -------------------------------------------------------------------

    def request_owned(self, req: Request, own_pages: np.ndarray) -> np.ndarray:
        """Pages (state slots) of this component's pool that ``req`` owns, given its own
        backbone pages ``own_pages``; checks what it holds is consistent."""
        return _NONE

    def check_node(self, node: TreeNode) -> None:  # noqa: B027 - optional hook
        """Check what this component keeps outside the tree for ``node`` (on the device)."""

    def check_request(self, req: Request) -> None:  # noqa: B027 - optional hook
        """Check what ``req`` needs of this component for its next token."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(idx={self.idx})"


class PagedComponent(TreeComponent):
    """A component whose value is one pool page per page of the node (FULL, SWA): the
    load-back hooks are the same for both, only the pool and the installing differ."""

    #: The value has one entry per page of the node (SWA: its pool page); else one per
    #: token (FULL: its slots).
    entry_per_page: bool = True

    def _entry_tokens(self) -> int:
        return self.page_size if self.entry_per_page else 1

    def size(self, value: np.ndarray) -> int:
        return int(value.size) * self._entry_tokens()

    def split(self, parent: ComponentData, child: ComponentData, k_tokens: int) -> None:
        if child.value is not None:
            k = k_tokens // self._entry_tokens()
            parent.value, child.value = child.value[:k], child.value[k:]
        parent.lock_ref = child.lock_ref
        parent.backed = child.backed

    def request_page_need(self, pages: int) -> int:
        return pages * self.page_size

    def load_need(self, plan: LoadPlan) -> int:
        return sum(n.num_tokens for n in plan.parts[self.idx])

    def load_from(self, plan: LoadPlan) -> int:
        """First token position whose pages a load-back brings (the nodes before it are
        left without this component on the device)."""
        return 0

    def install(self, node: TreeNode, pages: np.ndarray) -> None:
        """Make freshly loaded ``pages`` ``node``'s value."""
        raise NotImplementedError

    def plan_load(self, plan: LoadPlan) -> list[PageKey]:
        start = self.load_from(plan)
        need = [n for n in plan.nodes if n.start >= start and n.data[self.idx].value is None]
        plan.parts[self.idx] = need
        return [PageKey(self.ctype, h) for n in need for h in self.tree.node_hashes(n)]

    def _by_node(self, plan: LoadPlan, pages: np.ndarray) -> list[tuple[TreeNode, np.ndarray]]:
        out, off = [], 0
        for n in plan.parts[self.idx]:
            k = n.num_tokens // self.page_size
            out.append((n, pages[off : off + k]))
            off += k
        return out

    def prepare_load_back(self, plan: LoadPlan, req: Request | None) -> LoadPrep:
        need = plan.parts[self.idx]
        pages = self.pool().alloc_pages(sum(n.num_tokens for n in need) // self.page_size)
        try:
            refs = [r for n, p in self._by_node(plan, pages) for r in self.page_refs(n, p.tolist())]
        except BaseException:
            self.pool().free_pages(pages)  # no finalize follows a prepare that raised
            raise
        return LoadPrep(refs, pages)

    def finalize_load_back(
        self, plan: LoadPlan, req: Request | None, prep: LoadPrep, ok: bool
    ) -> None:
        if not ok:
            self.pool().free_pages(prep.allocated)
            return
        for node, pages in self._by_node(plan, prep.allocated):
            self.install(node, pages)
            # Loaded from the controller, so it holds them; an aux component counts as held
            # only with its backbone pages (the backbone finalizes first).
            if self.leaf_only or node.base.backed:
                node.data[self.idx].backed = True
