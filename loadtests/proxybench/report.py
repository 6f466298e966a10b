"""A run's report: tables per workload, probes, ratios, the issue's targets.

Contract: pure functions of the saved JSON document (``python -m
loadtests.proxybench report FILE`` prints one again); a Python target is
compared with the best C and the best Rust target of the same run only.
"""

from __future__ import annotations

from typing import Any

from .workloads import WORKLOADS


def _f(value: float | None, spec: str = ",.1f") -> str:
    return "—" if value is None else format(value, spec)


def _added(value: float | None, base: float | None) -> str:
    if value is None:
        return "—"
    if base is None:
        return _f(value, ".3f")
    return f"{value:.3f} ({value - base:+.3f})"


def table(workload: str, results: dict[str, Any]) -> str:
    base = results.get("direct", {}).get("workloads", {}).get(workload, {})
    lines = [f"### {WORKLOADS[workload]}", ""]
    if workload == "d":
        lines += [
            "| target | streams | established | RSS idle MiB | RSS with streams MiB | KiB/stream | proxy CPU µs/stream set-up |",  # noqa: E501
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
    else:
        lines += [
            "| target | req/s | x direct | MB/s sent | P50 ms | P99 ms | proxy CPU µs/req (range) | proxy core % | CPU 0 % | softirq % | others % | peak RSS MiB | split | errors |",  # noqa: E501
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
        ]
    for entry in results.values():
        row = entry["workloads"].get(workload)
        if row is None:
            continue
        label = entry["label"]
        if "error" in row:
            lines.append(f"| {label} | failed: {row['error'][:200]} |")
            continue
        if workload == "d":
            lines.append(
                f"| {label} | {row['streams']:,} | {row['established']:,} "
                f"| {_f(row.get('rss_idle_mib'))} | {_f(row.get('rss_streams_mib'))} "
                f"| {_f(row.get('kib_per_stream'))} | {_f(row.get('setup_cpu_us_per_stream'))} |"
            )
            continue
        ratio = row["rps"] / base["rps"] if base.get("rps") else None
        split = "/".join(str(n) for n in row["split"])
        if "invalid" in row:
            label += f" (invalid: {row['invalid']})"
        lines.append(
            f"| {label} | {row['rps']:,.0f} | {_f(ratio, '.2f')} | {row['request_mb_s']:,.1f} "
            f"| {_f(row['p50_ms'], '.3f')} | {_f(row['p99_ms'], '.3f')} "
            f"| {_cpu_cell(row)} | {_f(row['proxy_core_pct'], '.0f')} "
            f"| {_f(row['client_core_pct'], '.0f')} | {_f(row.get('softirq_core_pct'), '.0f')} "
            f"| {_f(row['others_core_pct'], '.0f')} "
            f"| {_f(row['rss_mib'])} "
            f"| {split} | {row['errors'] + row['bad_status']} |"
        )
    probes = probe_table(workload, results)
    return "\n".join(lines) + ("\n\n" + probes if probes else "")


def _cpu_cell(row: dict[str, Any]) -> str:
    spread = row.get("cpu_us_range")
    if row.get("cpu_us") is None or not spread or row.get("rounds", 1) < 2:
        return _f(row.get("cpu_us"))
    return f"{row['cpu_us']:.1f} ({spread[0]:.1f}-{spread[1]:.1f})"


def _base_probe(results: dict[str, Any], workload: str, probe: dict[str, Any]) -> dict[str, Any]:
    """Direct's probe of the same kind: the same rate, or the same closed-loop connections."""
    base = results.get("direct", {}).get("workloads", {}).get(workload, {})
    for candidate in base.get("probes", ()):
        if probe.get("connections"):
            if candidate.get("connections") == probe["connections"]:
                return dict(candidate)
        elif candidate["rate"] == probe["rate"] and not candidate.get("connections"):
            return dict(candidate)
    return {}


def probe_table(workload: str, results: dict[str, Any]) -> str:
    """The probes: added = this target's figure minus direct's in the same probe."""
    what = "time to first body byte" if workload == "b" else "latency"
    p50, p99 = ("ttfb_p50_ms", "ttfb_p99_ms") if workload == "b" else ("p50_ms", "p99_ms")
    if not any(e["workloads"].get(workload, {}).get("probes") for e in results.values()):
        return ""
    how = {
        "a": "our paced open-loop client on 32 keep-alive connections; latency from when each"
        " request is due; added = minus direct's at the same rate",
        "b": "our client, closed loop on a few keep-alive connections, each request sent as"
        " soon as the last one ended; the first chunk leaves the backend 2 ms after the head"
        " (a short prefill); added = minus direct's in the same probe",
    }[workload]
    lines = [
        f"Probe ({workload}): {how}.",
        "",
        f"| target | rate req/s | {what} P50 ms (added) | P99 ms (added) | full P50 ms | requests | errors |",  # noqa: E501
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    rows = 0
    for name, entry in results.items():
        for probe in entry["workloads"].get(workload, {}).get("probes", ()):
            rows += 1
            if probe.get("over_capacity"):
                lines.append(f"| {entry['label']} | {probe['rate']:,.0f} | over capacity | | | | |")
                continue
            base = {} if name == "direct" else _base_probe(results, workload, probe)
            lines.append(
                f"| {entry['label']} | {probe['rate']:,.0f} | {_added(probe[p50], base.get(p50))} "
                f"| {_added(probe[p99], base.get(p99))} | {_f(probe['p50_ms'], '.3f')} "
                f"| {probe['requests']:,} | {probe['errors']} |"
            )
    return "\n".join(lines) if rows else ""


def _best(results: dict[str, Any], workload: str, kind: str, field_: str, most: bool = False):  # type: ignore[no-untyped-def]
    rows = [
        (entry["workloads"][workload][field_], entry["label"])
        for entry in results.values()
        if entry["kind"] == kind
        and entry["workloads"].get(workload, {}).get(field_) is not None
        and "invalid" not in entry["workloads"][workload]
    ]
    if not rows:
        return None
    return max(rows) if most else min(rows)


def ratio_lines(results: dict[str, Any], workloads: list[str]) -> list[str]:
    """Each Python target against the best C and the best Rust target of this run."""
    out = []
    for workload in workloads:
        field_, unit = ("kib_per_stream", "KiB/stream") if workload == "d" else ("cpu_us", "µs/req")
        for entry in results.values():
            row = entry["workloads"].get(workload, {})
            if entry["kind"] != "Python" or row.get(field_) is None or "invalid" in row:
                continue
            parts = []
            for kind in ("C", "Rust"):
                best = _best(results, workload, kind, field_)
                if best is not None and best[0]:
                    parts.append(
                        f"{row[field_] / best[0]:.2f}x best {kind} ({best[1]}, {best[0]:g} {unit})"
                    )
            line = f"({workload}) {entry['label']}: {row[field_]:g} {unit}"
            if parts:
                line += " = " + ", ".join(parts)
            if workload != "d":
                rps = []
                for kind in ("C", "Rust"):
                    best = _best(results, workload, kind, "rps", most=True)
                    if best is not None and best[0]:
                        rps.append(
                            f"{row['rps'] / best[0]:.2f}x best {kind} ({best[1]}, {best[0]:,.0f})"
                        )
                line += f"; {row['rps']:,.0f} req/s" + (" = " + ", ".join(rps) if rps else "")
            out.append(line)
    return out


def target_checks(results: dict[str, Any]) -> list[str]:
    """prefix-router against the issue's targets, from this run's figures only."""
    ours = results.get("prefix-router", {}).get("workloads")
    if not ours:
        return []
    out = []

    def check(ok: bool, text: str) -> None:
        out.append(f"- [{'x' if ok else ' '}] {text}")

    for workload in ("a", "b"):
        cpu = ours.get(workload, {}).get("cpu_us")
        if cpu is None:
            continue
        rust = _best(results, workload, "Rust", "cpu_us")
        c = _best(results, workload, "C", "cpu_us")
        mine = f"({workload}) CPU/request {cpu:g} µs"
        if rust:
            check(cpu < rust[0], f"{mine} below the best Rust peer's ({rust[1]}, {rust[0]:g} µs)")
        if c:
            check(cpu <= 2 * c[0], f"{mine} within 2x the best C's ({c[1]}, {c[0]:g} µs)")
    a = ours.get("a", {})
    for probe in a.get("probes", ()):
        base = _base_probe(results, "a", probe)
        rate = f"at {probe['rate']:,.0f} req/s"
        if probe.get("over_capacity"):
            check(False, f"(a) added latency {rate}: over prefix-router's capacity here")
        elif base.get("p50_ms") is not None:
            p50 = probe["p50_ms"] - base["p50_ms"]
            p99 = probe["p99_ms"] - base["p99_ms"]
            check(p50 <= 0.2, f"(a) added latency P50 {p50:.3f} ms ≤ 0.2 ms {rate}")
            check(p99 <= 1.0, f"(a) added latency P99 {p99:.3f} ms ≤ 1 ms {rate}")
    c_row = ours.get("c", {})
    c_base = results.get("direct", {}).get("workloads", {}).get("c", {})
    if c_row.get("request_mb_s") and c_base.get("request_mb_s"):
        mb, base_mb = c_row["request_mb_s"], c_base["request_mb_s"]
        check(mb >= 0.8 * base_mb, f"(c) {mb:,.1f} MB/s = {mb / base_mb:.0%} of direct's (≥ 80 %)")
        if a.get("rss_mib") is not None:
            grew = c_row["rss_mib"] - a["rss_mib"]
            check(
                grew < 8,
                f"(c) peak RSS {c_row['rss_mib']:g} MiB with 64 KiB bodies, {a['rss_mib']:g} MiB"
                f" with 4 KiB ones ({grew:+.1f} MiB; under 8 MiB taken as independent)",
            )
    per_stream = ours.get("d", {}).get("kib_per_stream")
    if per_stream is not None:
        rust_rows = [
            (e["workloads"]["d"]["kib_per_stream"], e["label"])
            for e in results.values()
            if e["kind"] == "Rust" and e["workloads"].get("d", {}).get("kib_per_stream") is not None
        ]
        mine = f"(d) {per_stream:g} KiB per idle stream"
        if rust_rows:
            low = min(rust_rows)
            check(
                per_stream < low[0], f"{mine} below every Rust peer's (lowest {low[1]}, {low[0]:g})"
            )
        else:
            out.append(f"- {mine} (no Rust peer ran)")
    return out


def _ratio(mine: float | None, base: float | None) -> str:
    return f"{mine / base:.2f}x" if mine is not None and base else "—"


def _per_round(mine: dict[str, Any], base: dict[str, Any], key: str) -> str:
    """The ratio in each round (the targets take turns, so a round's pair shared its load)."""
    pairs = list(zip(mine.get("per_round", ()), base.get("per_round", ()), strict=False))
    ratios = [m[key] / b[key] for m, b in pairs if m.get(key) and b.get(key)]
    if len(ratios) < 2:
        return ""
    return f" (per round {min(ratios):.2f}-{max(ratios):.2f})"


def workers_table(results: dict[str, Any], workloads: list[str]) -> str:
    """prefix-router with N workers against 1 worker, both from this run."""
    base_entry = results.get("prefix-router")
    others = [e for n, e in results.items() if n.startswith("prefix-router-w")]
    if base_entry is None or not others:
        return ""
    lines = [
        "| target | workload | req/s | x 1 worker | CPU µs/req | x 1 worker | P50 ms | x 1 worker"
        " | P99 ms | x 1 worker | proxy core % |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    streams = [
        "| target | (d) streams | KiB/stream | x 1 worker | RSS idle MiB | x 1 worker |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for entry in others:
        for workload in workloads:
            mine = entry["workloads"].get(workload, {})
            base = base_entry["workloads"].get(workload, {})
            if workload == "d":
                if mine.get("kib_per_stream") is not None:
                    streams.append(
                        f"| {entry['label']} | {mine['established']:,} "
                        f"| {_f(mine['kib_per_stream'])} "
                        f"| {_ratio(mine['kib_per_stream'], base.get('kib_per_stream'))} "
                        f"| {_f(mine.get('rss_idle_mib'))} "
                        f"| {_ratio(mine.get('rss_idle_mib'), base.get('rss_idle_mib'))} |"
                    )
                continue
            if not mine.get("rps") or "invalid" in mine or "error" in mine:
                continue
            lines.append(
                f"| {entry['label']} | {workload} | {mine['rps']:,.0f} "
                f"| {_ratio(mine['rps'], base.get('rps'))}{_per_round(mine, base, 'rps')} "
                f"| {_f(mine['cpu_us'])} "
                f"| {_ratio(mine['cpu_us'], base.get('cpu_us'))}{_per_round(mine, base, 'cpu_us')} "
                f"| {_f(mine['p50_ms'], '.3f')} | {_ratio(mine['p50_ms'], base.get('p50_ms'))} "
                f"| {_f(mine['p99_ms'], '.3f')} | {_ratio(mine['p99_ms'], base.get('p99_ms'))} "
                f"| {_f(mine['proxy_core_pct'], '.0f')} |"
            )
    tables = [t for t in (lines, streams) if len(t) > 2]
    return "\n\n".join("\n".join(t) for t in tables)


LEGEND = """Columns (medians over the rounds): req/s and P50/P99 from the closed-loop
throughput runs; proxy CPU µs/req = (utime + stime of the proxy's process tree over a run)
/ requests, with its range over the rounds; proxy core % = that CPU time / wall time (100 =
one core's worth: pinned, the proxy's core was the limit, whatever its worker count);
CPU 0 % = the client side (generator, backends, this script) in % of one core (near 100 =
the client side was the limit); softirq % = interrupt time on both CPUs, mostly the
loopback network's, charged to no process (so in no CPU figure above); others % = CPU
taken meanwhile by processes outside this run (noise from a shared machine); split =
requests each backend answered."""


def report(doc: dict[str, Any]) -> str:
    meta, results = doc["meta"], doc["results"]
    parts = ["## How it ran", ""]
    parts += [f"- {k}: {v}" for k, v in meta.items()]
    parts += ["", "## What each target routes on", ""]
    parts += [f"- {e['label']} ({e['version']}): {e['key']}" for e in results.values()]
    if doc["skipped"]:
        parts += ["", "## Skipped", ""]
        parts += [f"- {name}: {reason}" for name, reason in doc["skipped"].items()]
    for workload in meta["workloads"]:
        parts += ["", table(workload, results)]
    parts += ["", LEGEND]
    lines = ratio_lines(results, meta["workloads"])
    if lines:
        parts += ["", "## Ratios (this run)", "", *(f"- {line}" for line in lines)]
    workers = workers_table(results, meta["workloads"])
    if workers:
        parts += ["", "## Workers (this run: x 1 worker = against prefix-router's figure)", ""]
        parts += [workers]
    logged = {e["label"]: e["log_problems"] for e in results.values() if "log_problems" in e}
    if logged:
        parts += ["", "## prefix-router logs (warnings, errors, lines that are not JSON)", ""]
        for label, found in logged.items():
            parts += [f"- {label}: {'none' if not found else len(found)}"]
            parts += [f"  - `{line}`" for line in found]
    checks = target_checks(results)
    if checks:
        parts += ["", "## prefix-router against the issue's targets", "", *checks]
    return "\n".join(parts)
