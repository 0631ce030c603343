"""How vLLM's offloaded blocks are named and laid out for the sidecar (no vLLM needed).

Two deployments that differ in anything that makes bytes unusable must never share a
page name, nor a sidecar layout; TP ranks of one deployment share the layout but not
their pages; the staged page holds the largest group's block.
"""

from __future__ import annotations

import dataclasses

from hicache.integrations.vllm_pages import GroupPages, PageNamespace
from hicache.types import ComponentType

GROUPS = (
    GroupPages(0, "FullAttentionSpec", (8192, 8192)),
    GroupPages(1, "SlidingWindowSpec(64)", (8192, 8192)),
    GroupPages(2, "MambaSpec", (304, 304)),
)
BASE = {
    "model": "org/model",
    "kv_dtype": "bfloat16",
    "tokens_per_block": (32, 32, 32),
    "groups": GROUPS,
    "tp_size": 2,
}
KEY = b"\x01" * 32 + (0).to_bytes(4, "big")


def test_every_field_that_makes_bytes_usable_changes_the_namespace_and_the_layout() -> None:
    base = PageNamespace.build(**BASE)
    changed = [
        {"model": "org/other"},
        {"kv_dtype": "float16"},
        {"tokens_per_block": (16, 16, 16)},
        {"tp_size": 4},
        {"groups": (*GROUPS[:2], dataclasses.replace(GROUPS[2], layer_page_bytes=(304, 320)))},
        {"groups": (GROUPS[0], dataclasses.replace(GROUPS[1], kind="SlidingWindowSpec(128)"))},
    ]
    for change in changed:
        other = PageNamespace.build(**{**BASE, **change})
        assert other.digest != base.digest, change
        assert other.page_hash(KEY, 0) != base.page_hash(KEY, 0), change
        assert other.layout().fingerprint(1) != base.layout().fingerprint(1), change
    assert PageNamespace.build(**BASE).page_hash(KEY, 0) == base.page_hash(KEY, 0)


def test_ranks_share_the_layout_but_not_their_pages() -> None:
    ns = PageNamespace.build(**BASE)
    assert ns.page_hash(KEY, 0) != ns.page_hash(KEY, 1)
    other_group = KEY[:-4] + (1).to_bytes(4, "big")
    assert ns.page_hash(other_group, 0) != ns.page_hash(KEY, 0)
    assert len({ns.page_hash(KEY, r) for r in range(2)} | {ns.root_hash}) == 3


def test_a_staged_page_holds_the_largest_group_in_the_sidecars_layout() -> None:
    ns = PageNamespace.build(**BASE)
    assert ns.page_bytes == 2 * 8192
    layout = ns.layout()
    assert layout.page_bytes(ComponentType.FULL, 1) == ns.page_bytes
    odd = PageNamespace.build(**{**BASE, "groups": (GroupPages(0, "MambaSpec", (300, 7)),)})
    assert odd.page_bytes == 312 and odd.page_bytes % 8 == 0
