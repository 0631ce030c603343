"""Tree nodes and the per-component data they carry.

A module of its own so that components, eviction policies, requests and tests can name a
node without importing the tree algorithm.
"""

from __future__ import annotations

import itertools
from typing import Any

from hicache.keys import TOKEN_BYTES

_node_ids = itertools.count(1)


class ComponentData:
    """One component's state on one node: device value, lock count, backed flag, LRU links.

    ``backed`` means the controller (host or disk tier) holds this component's pages of
    the node.
    """

    __slots__ = ("backed", "in_lru", "lock_ref", "lru_next", "lru_prev", "node", "value")

    def __init__(self, node: TreeNode) -> None:
        self.node = node
        self.value: Any = None
        self.lock_ref = 0
        self.backed = False
        self.lru_prev: ComponentData | None = None
        self.lru_next: ComponentData | None = None
        self.in_lru = False


class TreeNode:
    """A run of whole pages of tokens below ``parent``, starting at token ``start``.

    ``data`` holds one :class:`ComponentData` per component of the tree, by component
    index; ``base`` is the backbone's (FULL's), which decides whether the node exists on
    a tier at all (None on namespace roots, which carry no data).
    """

    __slots__ = (
        "base",
        "children",
        "data",
        "device_children",
        "hashes",
        "hit_count",
        "id",
        "in_policy",
        "key",
        "last_access",
        "namespace",
        "parent",
        "policy_state",
        "start",
    )

    def __init__(self, parent: TreeNode | None, key: bytes, start: int, n_components: int) -> None:
        self.id = next(_node_ids)
        self.parent = parent
        self.key = key
        self.start = start
        self.children: dict[bytes, TreeNode] = {}
        self.data = [ComponentData(self) for _ in range(n_components)]
        self.base: ComponentData | None = self.data[0] if n_components else None
        self.last_access = 0
        self.hashes: list[bytes] | None = None
        self.hit_count = 0
        self.device_children = 0
        self.in_policy = False
        self.policy_state: Any = None  # the leaf eviction policy's own record
        self.namespace: str | None = None  # set on namespace roots only

    @property
    def num_tokens(self) -> int:
        return len(self.key) // TOKEN_BYTES

    @property
    def end(self) -> int:
        return self.start + len(self.key) // TOKEN_BYTES

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def on_device(self) -> bool:
        """The backbone is on the device (the roots count as on the device)."""
        return self.parent is None or self.base.value is not None

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, [{self.start}, {self.end}), device={self.on_device})"
