"""What ``hicache demo`` shows: per-phase figures, their table, a plot and a progress bar."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

TIERS = ("device", "host", "disk")
# disk_to_device: pages held only on disk read straight into an engine's CPU pools
# (disk_load_direct), not through host pages.
DIRECTIONS = ("device_to_host", "host_to_device", "host_to_disk", "disk_to_host", "disk_to_device")
_ARROWS = {
    "device_to_host": "device→host",
    "host_to_device": "host→device",
    "host_to_disk": "host→disk",
    "disk_to_host": "disk→host",
    "disk_to_device": "disk→device",
}


@dataclass
class TimelinePoint:
    """One request finished in a cached run: when (seconds of cached serving since the
    demo began) and what it hit and computed."""

    t_s: float
    device: int
    host: int
    disk: int
    computed: int


@dataclass
class PhaseReport:
    """The figures of one phase. Times are wall seconds; ``no_cache_time_s`` is the same
    requests on the same engines with prefix reuse off (measured, not scaled)."""

    name: str
    description: str
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    hit_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    computed_tokens: int = 0
    no_cache_computed_tokens: int = 0
    bytes_moved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    time_s: float = 0.0
    no_cache_time_s: float = 0.0
    checked_tokens: int = 0
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    failed_requests: int = 0
    preemptions: int = 0
    load_back_failures: int = 0
    sidecar_unavailable_lookups: int = 0  # answered as misses: the sidecar did not answer
    start_s: float = 0.0  # on the timeline's clock: cached serving seconds before it
    timeline: list[TimelinePoint] = field(default_factory=list)

    def add_result(self, result: dict[str, Any]) -> None:
        """Count one cached-run result (a RequestResult as a dict)."""
        self.requests += 1
        self.prompt_tokens += result["prompt_tokens"]
        self.generated_tokens += len(result["output_ids"])
        self.hit_tokens["device"] += result["device_hit_tokens"]
        self.hit_tokens["host"] += result["host_hit_tokens"]
        self.hit_tokens["disk"] += result["disk_hit_tokens"]
        self.computed_tokens += result["computed_tokens"]
        self.preemptions += result["preemptions"]
        self.load_back_failures += result["load_back_failures"]
        self.failed_requests += result["error"] is not None

    @property
    def speedup(self) -> float:
        return self.no_cache_time_s / self.time_s if self.time_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["timeline"] = [asdict(p) for p in self.timeline]
        out["speedup"] = round(self.speedup, 3)
        return out


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def phase_table(phase: PhaseReport) -> str:
    """The phase's figures as an aligned two-column table."""
    hits = phase.hit_tokens
    rows = [
        ("requests", f"{phase.requests:,}"),
        ("prompt tokens", f"{phase.prompt_tokens:,}"),
        ("hit tokens: device", f"{hits['device']:,}"),
        ("hit tokens: host", f"{hits['host']:,}"),
        ("hit tokens: disk", f"{hits['disk']:,}"),
        ("tokens computed", f"{phase.computed_tokens:,}"),
        ("tokens computed, no cache", f"{phase.no_cache_computed_tokens:,}"),
    ]
    rows += [(f"bytes {_ARROWS[d]}", human_bytes(phase.bytes_moved[d])) for d in DIRECTIONS]
    rows += [
        ("time", f"{phase.time_s:.2f} s"),
        ("time, no cache", f"{phase.no_cache_time_s:.2f} s  ({phase.speedup:.2f}x)"),
        (
            "logits compared",
            f"{phase.checked_tokens:,} tokens, {len(phase.mismatches)} mismatches",
        ),
    ]
    if phase.sidecar_unavailable_lookups:
        rows.append(("lookups missed, sidecar busy", f"{phase.sidecar_unavailable_lookups}"))
    if phase.failed_requests or phase.preemptions or phase.load_back_failures:
        rows.append(
            (
                "failed / preempted / loads failed",
                f"{phase.failed_requests} / {phase.preemptions} / {phase.load_back_failures}",
            )
        )
    width = max(len(k) for k, _ in rows)
    title = f"{phase.name}: {phase.description}"
    lines = [title, "-" * len(title)]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)


def write_plot(phases: list[PhaseReport], path: Path) -> str | None:
    """A PNG of cumulative hit tokens per tier (and computed tokens) over cached serving
    time, a dashed line at each phase start. Returns None, having written nothing, when
    matplotlib is missing: the message says how to get it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (
            "matplotlib is not installed, so no plot was written; install it with "
            "`pip install 'hicache[plot]'` (or `.venv/bin/pip install matplotlib`)"
        )
    points = sorted((p for phase in phases for p in phase.timeline), key=lambda p: p.t_s)
    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=110)
    xs = [0.0] + [p.t_s for p in points]
    colors = {"device": "#2b8a3e", "host": "#1971c2", "disk": "#e8590c"}
    for tier in TIERS:
        total, ys = 0, [0]
        for p in points:
            total += getattr(p, tier)
            ys.append(total)
        ax.step(xs, ys, where="post", label=f"{tier} hits", color=colors[tier], linewidth=2)
    total, ys = 0, [0]
    for p in points:
        total += p.computed
        ys.append(total)
    ax.step(xs, ys, where="post", label="computed", color="#868e96", linestyle=":")
    for phase in phases:
        if phase.timeline:
            start = phase.start_s
            ax.axvline(start, color="#adb5bd", linestyle="--", linewidth=1)
            ax.annotate(
                phase.name,
                (start, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(3, -12),
                textcoords="offset points",
                fontsize=8,
            )
    ax.set_xlabel("cached serving time (s)")
    ax.set_ylabel("tokens (cumulative)")
    ax.set_title("hicache demo: prefix hits per tier")
    ax.legend(loc="upper left", bbox_to_anchor=(0.0, 0.92), fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


class Progress:
    """A plain-text progress bar on stderr: redrawn in place on a terminal, a line per
    quarter otherwise; silent when disabled."""

    def __init__(self, enabled: bool = True, stream: IO[str] | None = None, width: int = 30):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.width = width
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.total = 0
        self.done = 0
        self.label = ""
        self.began = time.perf_counter()
        self._last_quarter = -1

    def start(self, label: str, total: int) -> None:
        self.finish()
        self.label, self.total, self.done = label, max(total, 1), 0
        self.began = time.perf_counter()
        self._last_quarter = -1
        self._draw()

    def step(self, label: str | None = None, n: int = 1) -> None:
        if label is not None:
            self.label = label
        self.done = min(self.total, self.done + n)
        self._draw()

    def _draw(self) -> None:
        if not self.enabled or not self.total:
            return
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self.began
        text = f"[{bar}] {self.done}/{self.total} {self.label} ({elapsed:.1f} s)"
        if self.tty:
            self.stream.write("\r" + text.ljust(100)[:100])
            self.stream.flush()
            return
        quarter = 4 * self.done // self.total
        if quarter != self._last_quarter:
            self._last_quarter = quarter
            self.stream.write(text + "\n")
            self.stream.flush()

    def finish(self) -> None:
        if self.tty and self.total:
            self.stream.write("\n")
            self.stream.flush()
        self.total = 0

    def note(self, message: str, always: bool = False) -> None:
        """A line of its own (on a terminal, above the bar); ``always`` prints it even
        with the bar disabled."""
        if not (self.enabled or always):
            return
        if self.tty and self.total:
            self.stream.write("\r" + " " * 100 + "\r")
        self.stream.write(message + "\n")
        self.stream.flush()
        if self.tty and self.total:
            self._draw()
