"""CPU per request of the router on workload (a), for comparing two trees quickly.

    python -m loadtests.bench_cpu [--tree PATH] [--seconds 8] [--profile OUT]
    python -m loadtests.bench_cpu --otel [--rounds 5]
    python -m loadtests.bench_cpu --cache-salt [--rounds 5]
    python -m loadtests.bench_cpu --key-digests [--rounds 5]

Runs a ``Router`` from ``--tree`` (a checkout; default this one) in this
process on uvloop, in front of ``loadtests.fastbackend`` (2 instances, another
process), and drives it with wrk (1 thread, 16 keep-alive connections, the
proxy ladder's (a) body: OpenAI chat, 4 KiB prompt).  The router saturates its
core, so its CPU time over the run divided by the requests served is its cost
per request.  Alternate two trees several times and compare medians: one run
moves by ±10 % on a shared machine.  ``--profile OUT`` writes a cProfile dump
(the profiler roughly doubles the figure).

``--otel`` measures what tracing costs: ``--rounds`` pairs of runs, tracing
off then on (every request sampled, spans exported to the first backend's
``/v1/traces`` sink, in the backend process), and prints each run, the medians
and the ratio on/off.  Tracing's exporter runs in the router's process, so its
CPU is in the figure.

``--cache-salt`` does the same for engine-side cache isolation
(``router.cachesalt``): off and on, which goes first alternating by round (the
body carries a ``prompt_cache_key`` both ways, so on, each request gets its
tenant's ``cache_salt`` inserted); then, in this process, a request's keying
work (decode, key, tenant seed, hash) without and with the salt step, 100
tenants, median ns of 7 alternating runs of 20,000 requests.

``--key-digests`` does the same for the advisor's key digests
(``router.keydigests``), the access log written to a file both ways; then the
digests' own work in this process for three bodies (``_digest_work``).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _use_tree(tree: Path) -> None:
    """Import ``router`` from ``tree``, not from the editable install."""
    sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in type(f).__module__]
    sys.path.insert(0, str(tree))


async def run(
    seconds: float,
    profile: Path | None,
    body: bytes,
    otel: bool = False,
    overrides: dict[str, Any] | None = None,
) -> float:
    """One wrk run against a fresh router; prints it and returns its CPU µs per request."""
    from router.app import Router
    from router.config import build_config

    from . import supervisor

    children: list[supervisor.Child] = []
    try:
        backend = await supervisor.start(
            children,
            "fastbackend",
            [sys.executable, "-m", "loadtests.fastbackend"],
            cwd=ROOT,
            stdout=True,
        )
        deadline = asyncio.get_running_loop().time() + 20.0
        urls = [
            json.loads(await backend.line("a backend address", deadline, stdout=True))["url"]
            for _ in range(2)
        ]
        config: dict[str, Any] = {
            "listen": "127.0.0.1:0",
            "access_log": "off",
            "backends": [{"name": f"fb-{i}", "url": url} for i, url in enumerate(urls)],
            "health": {"active": False},
        }
        if otel:
            config["otel"] = {"endpoint": urls[0], "sample": 1.0}
        config.update(overrides or {})
        router = Router(build_config(config))
        await router.start()
        with tempfile.TemporaryDirectory() as scratch:
            (Path(scratch) / "body.json").write_bytes(body)
            script = Path(scratch) / "post.lua"
            script.write_text(
                'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                f'local f = io.open("{scratch}/body.json", "rb"); wrk.body = f:read("*a"); '
                "f:close()\n"
            )
            profiler = cProfile.Profile() if profile else None
            started = time.process_time()
            if profiler:
                profiler.enable()
            wrk = await asyncio.create_subprocess_exec(
                "wrk", "-t1", "-c16", f"-d{seconds:g}s", "-s", str(script),
                f"http://127.0.0.1:{router.port}/v1/chat/completions",
                stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            out, _ = await wrk.communicate()
            if profiler:
                profiler.disable()
                profiler.dump_stats(str(profile))
            cpu = time.process_time() - started
        tracer = getattr(router, "tracer", None)  # --tree: a build before tracing has none
        spans = tracer.counts() if tracer is not None else None
        await router.shutdown(grace=1)
        served = next(line for line in out.decode().splitlines() if "requests in" in line)
        requests = int(served.split()[0])
        per_request = cpu / requests * 1e6
        tracing = f"tracing on {spans} " if spans is not None and otel else ""
        if overrides:
            tracing += f"{', '.join(overrides)} on "
        print(f"{tracing}{requests:,} requests, router CPU {cpu:.2f} s: {per_request:.1f} us/req")
        return per_request
    finally:
        for child in children:
            await child.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench_cpu", description=__doc__)
    parser.add_argument("--tree", type=Path, default=ROOT, help="checkout to import router from")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--profile", type=Path, default=None, help="write a cProfile dump here")
    parser.add_argument("--otel", action="store_true", help="compare tracing off and on")
    parser.add_argument("--cache-salt", action="store_true", help="compare cache_salt off and on")
    parser.add_argument(
        "--key-digests", action="store_true", help="compare [advisor] key_digests off and on"
    )
    parser.add_argument("--rounds", type=int, default=5, help="with --otel: off/on pairs")
    args = parser.parse_args(argv)
    _use_tree(args.tree.resolve())
    from .proxybench.workloads import build_requests

    _, body = build_requests("a", 1)[0]
    import uvloop

    if args.cache_salt:
        return _cache_salt(args.seconds, args.rounds, body)
    if args.key_digests:
        return _key_digests(args.seconds, args.rounds, body)
    if not args.otel:
        uvloop.run(run(args.seconds, args.profile, body))
        return 0
    off, on = [], []
    for _ in range(args.rounds):
        off.append(uvloop.run(run(args.seconds, None, body)))
        on.append(uvloop.run(run(args.seconds, None, body, otel=True)))
    a, b = statistics.median(off), statistics.median(on)
    print(f"median of {args.rounds}: off {a:.1f} us/req, on {b:.1f} us/req")
    print(f"tracing on: +{b - a:.1f} us/req, ratio on/off {b / a:.2f}")
    return 0


def _cache_salt(seconds: float, rounds: int, body: bytes) -> int:
    """Off/on pairs of the router with ``cache_salt`` (which goes first alternates: the
    machine drifts), then the keying work of a request in this process, off and on."""
    import uvloop

    # A tenant key in the body both ways: only the salting differs.
    body = body[:-1] + b',"prompt_cache_key":"tenant-0042"}'
    off: list[float] = []
    on: list[float] = []
    with tempfile.TemporaryDirectory() as scratch:
        secret = Path(scratch) / "secret"
        secret.write_bytes(SECRET)
        salted: dict[str, Any] = {"cache_salt": {"enabled": True, "secret_file": str(secret)}}
        for i in range(rounds):
            for salt in (False, True) if i % 2 == 0 else (True, False):
                figure = uvloop.run(run(seconds, None, body, overrides=salted if salt else None))
                (on if salt else off).append(figure)
    a, b = statistics.median(off), statistics.median(on)
    print(f"router CPU, median of {rounds}: off {a:.1f} us/req, on {b:.1f} us/req")
    print(f"cache_salt on: {b - a:+.1f} us/req, ratio on/off {b / a:.2f}")
    _keying(body)
    return 0


def _key_digests(seconds: float, rounds: int, body: bytes) -> int:
    """Off/on pairs of the router with ``[advisor] key_digests``, the access log written
    to a file both ways (which goes first alternates); then the digests' own work in
    this process for three bodies."""
    import uvloop

    off: list[float] = []
    on: list[float] = []
    with tempfile.TemporaryDirectory() as scratch:
        log = str(Path(scratch) / "access.log")
        for i in range(rounds):
            for digests in (False, True) if i % 2 == 0 else (True, False):
                overrides: dict[str, Any] = {"access_log": log}
                if digests:
                    overrides["advisor"] = {"key_digests": True}
                figure = uvloop.run(run(seconds, None, body, overrides=overrides))
                (on if digests else off).append(figure)
    a, b = statistics.median(off), statistics.median(on)
    print(f"router CPU, access log on, median of {rounds}: off {a:.1f} us/req, on {b:.1f} us/req")
    print(f"key_digests on: {b - a:+.1f} us/req, ratio on/off {b / a:.2f}")
    _digest_work(body)
    return 0


def _digest_work(chat: bytes, count: int = 2_000, repeats: int = 7) -> None:
    """The digests' work alone, medians of ``repeats`` alternating runs: (a)'s chat body
    (its prompt longer than PrefixLength: rendered again at 65,540 characters), a
    ``long`` document (~33,000 characters) and a 64 KiB native body (in 16 KiB pieces)."""
    from hashring import PrefixHasher, hash_key
    from router.extract import decode_openai, prompt_key
    from router.keydigests import DEFAULT_LENGTHS, KeyDigester

    from .workloads import build, encode

    digester = KeyDigester(DEFAULT_LENGTHS)
    document = encode(build("long", seed=1, duration=2.0, rate=1.0)[0].chat_body())
    native = bytes(range(256)) * 256
    pieces = [memoryview(native)[i : i + 16384] for i in range(0, len(native), 16384)]

    def openai(body: bytes, digests: bool) -> None:
        for _ in range(count):
            request = decode_openai(body, 4096)
            key = prompt_key(request, 4096)
            hash_key(key)
            if digests:
                digester.openai(request, key, 4096, None)

    def body_pieces(_body: bytes, digests: bool) -> None:
        for _ in range(count):
            hasher = PrefixHasher(4096)
            native_digests = digester.native(4096, 0) if digests else None
            for piece in pieces:
                hasher.feed(piece)
                if native_digests is not None:
                    native_digests.feed(piece)
            hasher.digest()
            if native_digests is not None:
                native_digests.ended()
                native_digests.field()

    for name, work, sample in (
        ("(a) chat, 4 KiB prompt", openai, chat),
        ("long document, ~33,000 characters", openai, document),
        ("native 64 KiB in 4 pieces", body_pieces, native),
    ):
        samples: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(repeats):
            for digests in (False, True):
                started = time.perf_counter_ns()
                work(sample, digests)
                samples[digests].append((time.perf_counter_ns() - started) / count / 1000)
        a, b = statistics.median(samples[False]), statistics.median(samples[True])
        print(f"{name}: keying {a:.1f} us, with digests {b:.1f} us ({b - a:+.1f} us)")


SECRET = b"bench-secret-0123456789abcdef"


def _keying(body: bytes, count: int = 20_000, repeats: int = 7) -> None:
    """What an OpenAI request's keying costs in the exchange (decode, key, tenant
    seed, hash), without and with the salt step (``Salter.member``, ``salted_body``);
    100 tenants; runs alternate, medians of ``repeats``."""
    from hashring import hash_key, tenant_seed
    from router.cachesalt import Salter, salted_body
    from router.extract import decode_openai, prompt_key

    bodies = [body.replace(b"tenant-0042", b"tenant-%04d" % (i % 100)) for i in range(count)]
    salter = Salter(SECRET)

    def keying(salt: bool) -> None:
        for piece in bodies:
            request = decode_openai(piece, 4096)
            tenant = request.prompt_cache_key
            hash_key(prompt_key(request, 4096), tenant_seed(tenant))
            if salt:
                salted_body([piece], salter.member(tenant))

    samples: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):
        for salt in (False, True):
            started = time.perf_counter_ns()
            keying(salt)
            samples[salt].append((time.perf_counter_ns() - started) / count)
    a, b = statistics.median(samples[False]), statistics.median(samples[True])
    print(
        f"keying a request, median of {repeats}: off {a:.0f} ns, on {b:.0f} ns"
        f" ({b - a:+.0f} ns, ratio {b / a:.2f})"
    )


if __name__ == "__main__":
    sys.exit(main())
