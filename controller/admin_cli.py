"""The ``hicachectl`` admin command."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("hicachectl: no sidecar commands yet", file=sys.stderr)
    return 2
