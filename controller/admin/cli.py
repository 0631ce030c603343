"""``hicachectl``: inspect and drive a running sidecar.

Commands: ``status``, ``stats``, ``engines``, ``health``, ``clear``, ``evict``, ``pin``,
``unpin``, ``fsck``, ``score``, ``explain``. Every command takes ``--json`` (one JSON
document on stdout).

The admin connection authenticates with the admin token the sidecar writes beside its
socket (``admin.token``, mode 0600): only the sidecar's user can read it.

Exit codes (for scripts):

* 0 — done, and healthy / clean;
* 1 — done, but the answer is bad news: ``health`` unhealthy, ``fsck`` found corrupt
  values, ``pin`` found no cached page of the prefix;
* 2 — bad usage (arguments);
* 3 — the sidecar is unreachable or did not answer in time;
* 4 — refused: the admin token is missing or wrong;
* 5 — the sidecar refused the request (the message says why).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hicache.controller.client.admin import AdminClient
from hicache.controller.client.channel import (
    RemoteError,
    SidecarClientConfig,
    SidecarUnavailable,
)
from hicache.controller.sidecar.remote_status import print_remote_status
from hicache.controller.wire.protocol import (
    ErrorCode,
    Verb,
    normalize_endpoint,
)
from hicache.types import ConfigError

EXIT_OK, EXIT_BAD_NEWS, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_REFUSED, EXIT_ERROR = range(6)


# -- output -------------------------------------------------------------------------------


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _print_status(r: dict) -> None:
    layout = r.get("layout") or {}
    print(f"sidecar {r['version']} (protocol {r['protocol']}), pid {r['pid']}")
    print(f"  endpoints: {', '.join(r['endpoints'])}")
    print(f"  uptime:    {r['uptime_s']:.0f}s, engines {r['engines']}, in flight {r['inflight']}")
    if layout:
        print(
            f"  layout:    {layout['model_id']} page_size={layout['page_size']} "
            f"[{', '.join(layout['components'])}] {layout['fingerprint']}"
        )
    else:
        print("  layout:    none yet (no engine has connected)")
    host, disk = r.get("host", {}), r.get("disk", {})
    if host:
        print(
            f"  host:      {_human_bytes(host['used_bytes'])} used of "
            f"{_human_bytes(host['resident_bytes'])}"
        )
    if disk.get("enabled"):
        print(
            f"  disk:      {_human_bytes(disk['live_bytes'])} live, file "
            f"{_human_bytes(disk['file_bytes'])}, budget {_human_bytes(disk['budget_bytes'])}"
        )
        warm = disk.get("prewarm") or {}
        if warm.get("state", "off") != "off":
            print(
                f"  prewarm:   {warm['state']}, {_human_bytes(warm['bytes_read'])} of "
                f"{_human_bytes(warm['target_bytes'])} read back to host "
                f"({warm['pages_read']} of {warm['target_pages']} pages), "
                f"{_human_bytes(warm.get('bytes_advised', 0))} read ahead into the OS cache"
            )
    print(f"  pages:     {r['entries']} indexed, {r['pins_active']} pins")
    print_remote_status(r.get("remote", {}))


def _print_engines(r: dict) -> None:
    rows = r["engines"]
    if not rows:
        print("no connections")
        return
    print(f"{'ROLE':6} {'ENGINE':40} {'PID':>7} {'DEVICE':6} {'IDLE':>6} {'REQS':>8}")
    for e in rows:
        print(
            f"{e['role']:6} {e['engine_id'][:40]:40} {e['pid']:>7} {e['device'] or '-':6} "
            f"{e['idle_s']:>5.1f}s {e['requests']:>8}"
        )


def _print_flat(d: Any, prefix: str = "") -> None:
    if isinstance(d, dict):
        for k, v in d.items():
            _print_flat(v, f"{prefix}{k}.")
    else:
        print(f"{prefix[:-1]} {d}")


class _Progress:
    """A progress bar on stderr (only when asked, or when stderr is a terminal)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.drawn = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        width = 30
        frac = done / total if total else 1.0
        bar = "#" * int(frac * width)
        sys.stderr.write(f"\rfsck [{bar:<{width}}] {frac:6.1%} {done}/{total}")
        sys.stderr.flush()
        self.drawn = True

    def end(self) -> None:
        if self.drawn:
            sys.stderr.write("\n")


# -- commands -----------------------------------------------------------------------------


def _tokens(args: argparse.Namespace) -> list[int]:
    text = args.tokens
    if args.tokens_file:
        text = Path(args.tokens_file).read_text()
    if not text:
        raise ConfigError("give the prefix with --tokens 1,2,3 or --tokens-file FILE")
    text = text.strip()
    if text.startswith("["):
        return [int(t) for t in json.loads(text)]
    return [int(t) for t in text.replace(",", " ").split()]


def _prompt_args(args: argparse.Namespace) -> dict[str, Any]:
    """A prompt as ``--hashes`` (hex) or ``--tokens`` / ``--tokens-file`` (and
    ``--namespace``) name it."""
    if args.hashes:
        hexes = args.hashes.replace(",", " ").split()
        return {"hashes": b"".join(bytes.fromhex(h) for h in hexes)}
    a: dict[str, Any] = {"tokens": _tokens(args)}
    if args.namespace is not None:
        a["namespace"] = args.namespace
    return a


def _print_runs(runs: list[dict], indent: str = "  ") -> None:
    """Page by page (runs of alike pages), where each component is and why not."""
    for r in runs:
        span = (
            f"page {r['first']}" if r["first"] == r["last"] else f"pages {r['first']}-{r['last']}"
        )
        parts = []
        for comp, where in r["where"].items():
            why = r["why"].get(comp)
            if why is None:
                parts.append(f"{comp} {where}")
                continue
            text = why["reason"] + ("" if why["tier"] == "none" else f" ({why['tier']})")
            if why["age_s"] is not None:
                text += f" {why['age_s']:.1f}s ago"
            parts.append(f"{comp} absent: {text}")
        print(f"{indent}{span:14} " + "; ".join(parts))


def _print_explain(r: dict) -> None:
    if "lookups" in r:
        print(f"engine {r['engine']}: last {len(r['lookups'])} lookups, oldest first")
        for n, lk in enumerate(r["lookups"], 1):
            misses = ", ".join(
                f"{c} {m['reason']}" + ("" if m["tier"] == "none" else f" ({m['tier']})")
                for c, m in lk["first_miss"].items()
            )
            print(
                f"lookup {n}: {lk['age_s']:.1f}s ago, {lk['pages']} pages; first miss: "
                f"{misses or 'none'}"
            )
            for f in lk["load_failures"]:
                print(f"  load failed: {f['reason']} ({f['tier']})")
            _print_runs(lk["runs"])
        return
    print(f"prompt: {r['pages']} pages of {r['page_size']} tokens")
    _print_runs(r["runs"])


def run(client: AdminClient, args: argparse.Namespace) -> tuple[dict, int]:
    """Run one command; returns (result, exit code)."""
    cmd = args.command
    if cmd in ("status", "stats", "engines", "health"):
        verb = {"status": Verb.STATUS, "stats": Verb.STATS, "engines": Verb.ENGINES}.get(
            cmd, Verb.HEALTH
        )
        r = client.call(verb)
        code = EXIT_BAD_NEWS if cmd == "health" and r.get("status") != "ok" else EXIT_OK
        return r, code
    if cmd == "clear":
        tiers = ["host", "disk"] if args.tier == "all" else [args.tier]
        ns_given = args.namespace is not None or args.default_namespace
        a: dict[str, Any] = {"tiers": tiers, "all_namespaces": not ns_given}
        if args.namespace is not None:
            a["namespace"] = args.namespace
        return client.call(Verb.CLEAR, a), EXIT_OK
    if cmd == "evict":
        from hicache.controller.sidecar.process import parse_size

        a = {"tier": args.tier, "bytes": parse_size(args.bytes, "--bytes")}
        if args.component:
            a["component"] = args.component
        return client.call(Verb.EVICT, a), EXIT_OK
    if cmd == "pin":
        a = {"tokens": _tokens(args), "ttl_s": args.ttl}
        if args.namespace is not None:
            a["namespace"] = args.namespace
        r = client.call(Verb.PIN_PREFIX, a)
        return r, EXIT_OK if r.get("pin_id") is not None else EXIT_BAD_NEWS
    if cmd == "unpin":
        return client.call(Verb.UNPIN_PREFIX, {"pin_id": args.pin_id}), EXIT_OK
    if cmd == "score":
        a = _prompt_args(args)
        if args.sliding_window is not None:
            a["sliding_window"] = args.sliding_window
        return client.call(Verb.SCORE, a), EXIT_OK
    if cmd == "explain":
        if args.engine is not None:
            return client.call(Verb.EXPLAIN, {"engine": args.engine, "last": args.last}), EXIT_OK
        return client.call(Verb.EXPLAIN, _prompt_args(args)), EXIT_OK
    if cmd == "fsck":
        bar = _Progress(args.progress if args.progress is not None else sys.stderr.isatty())
        try:
            r = client.call(Verb.FSCK, {"repair": args.repair}, progress=bar)
        finally:
            bar.end()
        return r, EXIT_BAD_NEWS if r.get("corrupt") else EXIT_OK
    raise AssertionError(cmd)


def _show(cmd: str, r: dict) -> None:
    if cmd == "status":
        _print_status(r)
    elif cmd == "engines":
        _print_engines(r)
    elif cmd == "health":
        checks = ", ".join(f"{k}={'ok' if v else 'FAIL'}" for k, v in r["checks"].items())
        print(f"{r['status']}: {checks}")
    elif cmd == "pin":
        if r.get("pin_id") is None:
            print("nothing pinned: no page of that prefix is cached")
        else:
            print(
                f"pin {r['pin_id']}: {r['tokens']} tokens ({r['pages']} pages) "
                f"for {r['ttl_s']:.0f}s"
            )
    elif cmd == "score":
        page = r["page_size"]
        print(f"prompt: {r['pages']} pages of {page} tokens")
        for tier in ("host", "disk", "remote"):
            n, kv = r["resumable"][tier], r["kv_pages"][tier]
            print(f"  up to {tier:6}: resumes {n * page} tokens ({n} pages; KV pages {kv})")
    elif cmd == "explain":
        _print_explain(r)
    elif cmd == "fsck":
        print(
            f"fsck: {r['checked']} values, {r['ok']} ok, {r['corrupt']} corrupt, "
            f"{r['foreign']} of another layout, {r['repaired']} repaired"
            + (
                f" (layout unchecked for {r['layout_unchecked']}: no engine has registered)"
                if r.get("layout_unchecked")
                else ""
            )
        )
    else:
        _print_flat(r)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hicachectl",
        description="Inspect and drive a hicache sidecar.",
        epilog="exit codes: 0 ok, 1 bad news (unhealthy, corrupt, nothing pinned), 2 usage, "
        "3 unreachable, 4 refused (admin token), 5 request refused",
    )
    p.add_argument("--socket", help="the sidecar's Unix socket (default: the serve default)")
    p.add_argument("--endpoint", help="ipc://… or tcp://… (instead of --socket)")
    p.add_argument("--token-file", help="the admin token (default: admin.token by the socket)")
    p.add_argument("--tcp-token-file", help="TCP token (when the sidecar uses tcp_auth=token)")
    p.add_argument("--curve-server-key", help="the sidecar's public CURVE certificate")
    p.add_argument("--curve-client-cert", help="this client's secret CURVE certificate")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (
        ("status", "version, endpoints, layout, tiers"),
        ("stats", "every counter and residency"),
        ("engines", "connected engines and admin tools"),
        ("health", "exit 0 when healthy, 1 when not"),
    ):
        s = sub.add_parser(name, help=text)
        s.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    c = sub.add_parser("clear", help="drop unpinned pages (tail first; pins are kept)")
    c.add_argument("--tier", choices=["host", "disk", "all"], default="all")
    g = c.add_mutually_exclusive_group()
    g.add_argument("--namespace", help="only this namespace (extra_key)")
    g.add_argument("--default-namespace", action="store_true", help="only the unnamed one")
    e = sub.add_parser("evict", help="evict least recently used pages")
    e.add_argument("--tier", choices=["host", "disk"], required=True)
    e.add_argument("--bytes", required=True, help="how much to free, e.g. 1GiB")
    e.add_argument("--component", choices=["full", "swa", "mamba"])
    pn = sub.add_parser("pin", help="pin a cached prefix against eviction for a TTL")
    pn.add_argument("--tokens", help="token ids, comma or space separated")
    pn.add_argument("--tokens-file", help="a file of token ids (JSON list or separated)")
    pn.add_argument("--namespace", help="the prefix's namespace (extra_key)")
    pn.add_argument("--ttl", type=float, default=600.0, help="seconds (capped by pin_ttl_max_s)")
    sc = sub.add_parser("score", help="how much of a prompt each tier can resume")
    sc.add_argument("--hashes", help="the prompt's page hashes, hex, comma or space separated")
    sc.add_argument("--tokens", help="or its token ids, comma or space separated")
    sc.add_argument("--tokens-file", help="a file of token ids (JSON list or separated)")
    sc.add_argument("--namespace", help="the prompt's namespace (extra_key), with --tokens")
    sc.add_argument("--sliding-window", type=int, help="the model's SWA window in tokens")
    x = sub.add_parser("explain", help="page by page, where a prompt is and why the rest is not")
    x.add_argument("--hashes", help="the prompt's page hashes, hex, comma or space separated")
    x.add_argument("--tokens", help="or its token ids, comma or space separated")
    x.add_argument("--tokens-file", help="a file of token ids (JSON list or separated)")
    x.add_argument("--namespace", help="the prompt's namespace (extra_key), with --tokens")
    x.add_argument("--engine", help="or an engine's last lookups (its id, from 'engines')")
    x.add_argument("--last", type=int, default=1, help="with --engine: how many lookups")
    u = sub.add_parser("unpin", help="release a pin made by 'pin'")
    u.add_argument("pin_id", type=int)
    f = sub.add_parser("fsck", help="check every LMDB value's checksum")
    f.add_argument("--repair", action="store_true", help="drop corrupt values")
    f.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    for s in (c, e, pn, sc, x, u, f):
        s.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    endpoint = args.endpoint or (normalize_endpoint(args.socket) if args.socket else None)
    config = SidecarClientConfig(
        tcp_token_file=args.tcp_token_file,
        curve_server_public_key_file=args.curve_server_key,
        curve_client_cert_file=args.curve_client_cert,
    )
    try:
        try:
            client = AdminClient(
                endpoint, token_file=args.token_file, timeout_s=args.timeout, config=config
            )
        except SidecarUnavailable as exc:
            print(f"hicachectl: {exc}", file=sys.stderr)
            return EXIT_UNREACHABLE
        except (PermissionError, ConfigError) as exc:
            print(f"hicachectl: {exc}", file=sys.stderr)
            return EXIT_REFUSED if isinstance(exc, PermissionError) else EXIT_USAGE
        try:
            result, code = run(client, args)
        finally:
            client.close()
    except SidecarUnavailable as exc:
        print(f"hicachectl: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except RemoteError as exc:
        print(f"hicachectl: {exc.message}", file=sys.stderr)
        return EXIT_REFUSED if exc.code == ErrorCode.FORBIDDEN.value else EXIT_ERROR
    except (ConfigError, ValueError, OSError) as exc:
        print(f"hicachectl: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        _show(args.command, result)
    return code


if __name__ == "__main__":
    sys.exit(main())
