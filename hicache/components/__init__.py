"""The kinds of cached state a tree node carries, one TreeComponent each.

``COMPONENT_CLASSES`` names the class of every shipped component type; a cache built for
a layout carries one instance per component type of the layout, FULL (the backbone)
first. Another component plugs in by passing its class to the cache (``components=``).
"""

from __future__ import annotations

from hicache.components.base import TreeComponent
from hicache.components.full import FullComponent
from hicache.components.mamba import MambaComponent
from hicache.components.swa import SWAComponent
from hicache.types import ComponentType

COMPONENT_CLASSES: dict[ComponentType, type[TreeComponent]] = {
    ComponentType.FULL: FullComponent,
    ComponentType.SWA: SWAComponent,
    ComponentType.MAMBA: MambaComponent,
}
