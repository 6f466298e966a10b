"""CLI: ``python -m loadtests.simserver [--count N] [--port P] [model and cache flags]``.

Starts N instances in this process (named ``NAME`` when N is 1, else ``NAME-0`` ..
``NAME-{N-1}``) on ports P, P+1, ... (all ephemeral when P is 0), then prints one
JSON line per instance, ``{"name": ..., "url": ...}``, to stdout and flushes, so a
parent process can read where they listen. Nothing else goes to stdout. SIGTERM or
SIGINT closes them and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from dataclasses import replace

from .app import SimConfig, serve_fleet
from .model import Timing
from .wire import Limits


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    t, c, lim = Timing(), SimConfig(), Limits()
    p = argparse.ArgumentParser(
        prog="python -m loadtests.simserver",
        description="Simulated vLLM instances for router tests and benchmarks.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--name", default=c.name, help="instance name (suffixed -i when --count > 1)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=0, help="first port; 0 = ephemeral ports")
    p.add_argument("--count", type=int, default=1, help="instances to run in this process")
    p.add_argument("--model", default=c.model, help="served model name")
    p.add_argument(
        "--strict-model",
        action="store_true",
        help="answer 404 to a request naming another model, as vLLM does",
    )
    p.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=t.prefill_tokens_per_s,
        help="prefill rate of uncached prompt tokens, model time",
    )
    p.add_argument(
        "--overhead-ms",
        type=float,
        default=t.request_overhead_s * 1000,
        help="fixed per-request cost, serialised with prefill",
    )
    p.add_argument(
        "--decode-ms",
        type=float,
        default=t.decode_s_per_token * 1000,
        help="model time per output token after the first",
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=t.max_num_seqs, help="batch limit; excess waits FIFO"
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=t.time_scale,
        help="real seconds per model second, applied to every model delay",
    )
    p.add_argument("--block-size", type=int, default=c.block_size, help="tokens per KV block")
    p.add_argument(
        "--capacity-blocks", type=int, default=c.capacity_blocks, help="KV cache size in blocks"
    )
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="run as vLLM without --enable-prefix-caching: no hits, prefix-cache counters at 0",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=lim.default_max_tokens,
        help="output tokens when a request names none",
    )
    p.add_argument(
        "--max-tokens-cap",
        type=int,
        default=lim.max_tokens_cap,
        help="larger max_tokens are lowered to this",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=lim.max_model_len,
        help="prompt + output limit in tokens (400 beyond)",
    )
    p.add_argument(
        "--extra-ttft-ms",
        type=float,
        default=0.0,
        help="test hook: real delay added before every first byte",
    )
    p.add_argument(
        "--extra-token-ms",
        type=float,
        default=0.0,
        help="test hook: real delay added between streamed tokens",
    )
    args = p.parse_args(argv)
    if args.count < 1:
        p.error("--count must be >= 1")
    if args.port and args.port + args.count - 1 > 65535:
        p.error("--port + --count exceeds 65535")
    return args


def configs_from(args: argparse.Namespace) -> list[SimConfig]:
    base = SimConfig(
        name=args.name,
        model=args.model,
        timing=Timing(
            prefill_tokens_per_s=args.prefill_tokens_per_s,
            request_overhead_s=args.overhead_ms / 1000,
            decode_s_per_token=args.decode_ms / 1000,
            max_num_seqs=args.max_num_seqs,
            time_scale=args.time_scale,
        ),
        block_size=args.block_size,
        capacity_blocks=args.capacity_blocks,
        limits=Limits(args.default_max_tokens, args.max_tokens_cap, args.max_model_len),
        extra_ttft_s=args.extra_ttft_ms / 1000,
        extra_token_s=args.extra_token_ms / 1000,
        strict_model=args.strict_model,
        prefix_caching=not args.no_prefix_caching,
    )
    if args.count == 1:
        return [base]
    return [replace(base, name=f"{args.name}-{i}") for i in range(args.count)]


async def serve(args: argparse.Namespace) -> None:
    configs = configs_from(args)
    ports = [args.port + i if args.port else 0 for i in range(len(configs))]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with serve_fleet(configs, args.host, ports) as servers:
        for server in servers:
            sys.stdout.write(json.dumps({"name": server.name, "url": server.url}) + "\n")
        sys.stdout.flush()
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        configs_from(args)  # validate every value before binding any port
    except ValueError as exc:
        print(f"simserver: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
