"""``prefix-router advise`` (``python -m loadtests.advise``): which PrefixLength fits this traffic.

    prefix-router advise access.log [access-2.log ...] [--config router.toml]
        [--lengths 1024,2048,...] [--instances N | --backends NAME,...]
        [--fleet NAME | --capacity-blocks N ...]
        [--time-scale S] [--json]
    prefix-router advise --bodies sample.jsonl [...]

The command line.  The work is in two modules, each with its contract:
``loadtests.advise_sample`` reads the sample (access logs or ``--bodies``)
into requests by their key digests, ``loadtests.advise_replay`` replays it
at each candidate PrefixLength and recommends one.  The names other code
reads here (``advise.key_body``, ``advise.advise``, ...) are theirs,
re-exported.

Contract
--------
- Candidates: the logged lengths from 1,024 to 65,536 (``--lengths`` picks
  some).  The current PrefixLength is ``--prefix-length``, else the
  config file's, else the logged length whose digest equals the lines'
  ``prefix_hash`` most often (a cut key's digests only: a whole key's
  digest is its key at every longer length too, so it names no length).
- The fleet model: ``--instances`` (default: the backends named in the
  sample, by their names, weight 1 each) of the simulated engine with the
  timing and KV cache of ``--fleet NAME`` (``loadtests.workloads.FLEET``;
  default the 70B fleet every workload uses) or the ``simserver`` flags
  given (``--capacity-blocks``, ``--prefill-tokens-per-s``, ...); set them
  to your engines' to predict their hit rates.  ``--time-scale S``: the
  sample came from a simulated fleet running S wall seconds a model second.
- Output: the table and the recommendation on stdout (``--json``: one JSON
  document instead); progress on stderr.  Exit 2 on unusable input (no
  line with digests, fewer than two requests, an unknown length).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

from admin.cli import prefix_aware_flags
from router.config import ConfigError, RoutingConfig, build_config, load_toml, parse_routing
from router.keydigests import DEFAULT_LENGTHS

from .advise_replay import (
    MAX_PREFIX_LENGTH,
    MIN_PREFIX_LENGTH,
    Advice,
    Row,
    advise,
    groups,
    link,
    recommend,
    table,
)
from .advise_sample import (
    Reading,
    Sample,
    Sampled,
    from_bodies,
    from_log,
    key_body,
    sample_request,
)
from .workloads import FLEET, FleetParams

__all__ = [
    "MIN_PREFIX_LENGTH",
    "Advice",
    "Reading",
    "Row",
    "Sampled",
    "advise",
    "from_bodies",
    "from_log",
    "groups",
    "key_body",
    "link",
    "main",
    "recommend",
    "sample_request",
]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="prefix-router advise",
        description="Predict the hit rate of each PrefixLength from a traffic sample"
        " (access logs with [advisor] key_digests, or --bodies) and recommend one.",
    )
    p.add_argument("logs", nargs="*", metavar="ACCESS_LOG", help="access-log files ('-': stdin)")
    p.add_argument("--bodies", metavar="FILE", help="a captured body sample (JSON lines)")
    p.add_argument("--config", metavar="FILE", help="the router's TOML: RoutingConfig, [advisor]")
    p.add_argument(
        "--lengths", metavar="N,N,...", help="candidates (default: every logged length in range)"
    )
    p.add_argument("--prefix-length", type=int, metavar="N", help="the current PrefixLength")
    p.add_argument("--concurrency-threshold", type=int, metavar="N")
    p.add_argument("--balance-factor", type=float, metavar="C")
    p.add_argument("--balance-mode", choices=("IN_FLIGHT", "TRAFFIC"))
    p.add_argument("--concurrency-scope", choices=("IN_FLIGHT", "PREFILL"))
    p.add_argument("--tolerance", type=float, default=0.5, help="points of hit rate (0.5)")
    p.add_argument(
        "--instances", type=int, metavar="N", help="backends (default: those in the sample)"
    )
    p.add_argument(
        "--backends",
        metavar="NAME,...",
        help="only the lines these backends answered, replayed on them (one model's pool)",
    )
    p.add_argument(
        "--fleet", choices=sorted(FLEET), help="a simulated fleet's model (default: long's)"
    )
    for flag, what in (
        ("--capacity-blocks", "KV cache blocks an instance"),
        ("--block-size", "tokens a block"),
        ("--max-num-seqs", "sequences an instance runs at once"),
        ("--default-max-tokens", "output tokens of a body without output_tokens"),
    ):
        p.add_argument(flag, type=int, metavar="N", help=what)
    for flag, what in (
        ("--prefill-tokens-per-s", "prefill speed"),
        ("--overhead-ms", "fixed cost a request"),
        ("--decode-ms", "time an output token"),
    ):
        p.add_argument(flag, type=float, metavar="X", help=what)
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds a model second of the fleet that served the sample (simulated fleets)",
    )
    p.add_argument(
        "--lower-bound",
        action="store_true",
        help="share only what the digests show (no estimate of the rest)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    return p.parse_args(argv)


def fleet_params(args: argparse.Namespace) -> FleetParams:
    params = FLEET[args.fleet or "long"]
    overrides: dict[str, Any] = {}
    for flag, field, scale in (
        ("capacity_blocks", "capacity_blocks", 1),
        ("block_size", "block_size", 1),
        ("max_num_seqs", "max_num_seqs", 1),
        ("default_max_tokens", "default_max_tokens", 1),
        ("prefill_tokens_per_s", "prefill_tokens_per_s", 1),
        ("overhead_ms", "request_overhead_s", 1000),
        ("decode_ms", "decode_s_per_token", 1000),
    ):
        value = getattr(args, flag)
        if value is not None:
            overrides[field] = value / scale if scale != 1 else value
    return replace(params, **overrides)


def _routing(args: argparse.Namespace) -> tuple[RoutingConfig, tuple[int, ...], int | None]:
    """The RoutingConfig (file, then flags), the [advisor] lengths, the file's PrefixLength."""
    data = load_toml(args.config) if args.config else {}
    routing = dict(data.get("RoutingConfig", {}))
    file_length = routing.get("PrefixAwareRoutingConfig", {}).get("PrefixLength")
    inner = {**routing.get("PrefixAwareRoutingConfig", {}), **prefix_aware_flags(args)}
    routing["PrefixAwareRoutingConfig"] = inner
    config = parse_routing(routing)
    lengths = build_config({"advisor": data.get("advisor", {})}).advisor.lengths
    return config, tuple(lengths) if args.config else DEFAULT_LENGTHS, file_length


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if bool(args.logs) == bool(args.bodies):
        print("advise: give access-log files or --bodies FILE (one of them)", file=sys.stderr)
        return 2
    backends = None
    if args.backends is not None:
        backends = sorted({name.strip() for name in args.backends.split(",") if name.strip()})
        if not backends or args.bodies:
            print("advise: --backends NAME,... reads access logs (their backend)", file=sys.stderr)
            return 2
    try:
        routing, logged, file_length = _routing(args)
        params = fleet_params(args)
        reading = Reading(params.decode_s_per_token, args.time_scale, params.default_max_tokens)
        if args.bodies:
            sample = from_bodies(args.bodies, routing, logged, reading)
        else:
            sample = from_log(args.logs, reading, backends)
    except (ConfigError, OSError) as exc:
        print(f"advise: {exc}", file=sys.stderr)
        return 2
    if len(sample.requests) < 2:
        why = ", ".join(f"{n} {what}" for what, n in sample.skipped.items()) or "no lines"
        print(f"advise: fewer than two usable requests in the sample ({why})", file=sys.stderr)
        return 2
    in_range = [g for g in sample.lengths if MIN_PREFIX_LENGTH <= g <= MAX_PREFIX_LENGTH]
    if args.lengths:
        try:
            wanted = [int(x) for x in args.lengths.split(",") if x.strip()]
        except ValueError:
            print(f"advise: --lengths {args.lengths!r} is not N,N,...", file=sys.stderr)
            return 2
        missing = sorted(set(wanted) - set(in_range))
        if missing:
            print(
                f"advise: no digests at {missing} in the sample (logged: {list(sample.lengths)})",
                file=sys.stderr,
            )
            return 2
        in_range = wanted
    current = args.prefix_length or file_length or sample.current or 4096
    if current not in sample.lengths:
        print(
            f"advise: the current PrefixLength {current} is not among the logged lengths"
            f" {list(sample.lengths)}",
            file=sys.stderr,
        )
        return 2
    names = sample.backends if backends is None else backends
    if args.instances is not None or not names:
        names = [f"sim-{i}" for i in range(args.instances or params.instances)]
    print(
        f"advise: {len(sample.requests):,} requests over"
        f" {sample.requests[-1].at - sample.requests[0].at:,.0f} s, {len(names)} instances,"
        f" replaying {len(set(in_range) | {current})} PrefixLengths",
        file=sys.stderr,
        flush=True,
    )
    advice = advise(
        sample.requests,
        routing,
        in_range,
        current,
        instances=names,
        params=params,
        tolerance=args.tolerance,
        seed=args.seed,
        lower_bound=args.lower_bound,
    )
    if args.json:
        out = {
            "recommended": advice.recommended,
            "reason": advice.reason,
            "current": advice.current,
            "hit_rates": "lower bound" if args.lower_bound else "estimate",
            "requests": advice.requests,
            "span_s": advice.span_s,
            "instances": advice.instances,
            "skipped": dict(sample.skipped),
            "rows": [vars(r) for r in advice.rows],
        }
        print(json.dumps(out, indent=1))
        return 0
    print(_heading(advice, sample, args.lower_bound))
    print()
    print(table(advice))
    print()
    print(f"recommendation: PrefixLength {advice.recommended}")
    print(f"  why: {advice.reason}")
    return 0


def _heading(advice: Advice, sample: Sample, lower_bound: bool) -> str:
    text = (
        f"{advice.requests:,} requests over {advice.span_s:,.0f} s"
        f" from {sample.files} file{'s' if sample.files != 1 else ''},"
        f" {len(advice.instances)} instances; current PrefixLength {advice.current};"
        f" {advice.groups:,} groups of 2+ requests"
    )
    if sample.skipped:
        text += "\nskipped: " + ", ".join(f"{n:,} {what}" for what, n in sample.skipped.items())
    if lower_bound:
        text += "\nhit rates: lower bounds (requests share what their digests show, no more)"
    return text


if __name__ == "__main__":
    sys.exit(main())
