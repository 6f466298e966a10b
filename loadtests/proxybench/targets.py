"""The proxies under test: what each routes on, its configuration, how it starts.

Contract: ``start_target`` starts one target in front of ``ctx.backends`` on
the proxy CPUs (a ``loadtests.supervisor`` child logging to a file in
``ctx.tmp``, registered in ``ctx.children``, or a peer from
``loadtests.peers``) and returns once a request through it is answered;
``availability`` says, per target, why it cannot run here (after
``--install``: apt-get and the peers' venv), or None.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httptools

from .. import peers, supervisor
from ..fleet import SERVE, listening_address
from ..supervisor import Child, ChildError, say
from .client import fetch_json
from .procfs import on_cpu
from .workloads import PREFIX

START_TIMEOUT_S = 30.0


APT = {"wrk": "wrk", "haproxy": "haproxy", "nginx": "nginx"}  # binary -> Debian package


@dataclass(frozen=True)
class Target:
    name: str  # for --targets
    label: str  # in tables
    kind: str  # ceiling | C | Rust | Python
    key: str  # what it routes on, as close to our key as it allows


TARGETS = (
    Target("direct", "direct (no proxy)", "ceiling", "none: the client talks to fb-0"),
    Target(
        "haproxy", "HAProxy", "C",
        "`balance hash req.body,bytes(0,4096)`, `hash-type consistent`, `hash-balance-factor"
        " 150`: the first 4,096 bytes of the buffered body (`option http-buffer-request`)",
    ),
    Target(
        "nginx", "nginx", "C",
        "`hash $prefix_key consistent`, `$prefix_key` = the first 4,096 bytes of"
        " `$request_body` (a `map` regex; body held in memory); no load bound",
    ),
    Target(
        "sglang", "sglang-router cache_aware", "Rust",
        "cache_aware: radix tree on the messages' text (roles left out); load-balances"
        " past its thresholds",
    ),
    Target(
        "vllm-ca", "vllm-router cache_aware", "Rust",
        "cache_aware: prefix tree on token ids that EVERY worker returns from /render"
        " (a render call per worker per request)",
    ),
    Target(
        "vllm-ch", "vllm-router consistent_hash", "Rust",
        "consistent_hash on the `x-session-id` header (one per prompt): its only key",
    ),
    Target(
        "aiohttp", "aiohttp floor", "Python",
        "crc32 of the first 4,096 body bytes modulo the backends (no ring, no bound)",
    ),
    Target(
        "prefix-router", "prefix-router", "Python",
        "PREFIX_AWARE: mmh3 of the first 4,096 characters of the extracted prompt (chat)"
        " or body bytes (native); bounded-load consistent hashing",
    ),
    Target(
        "prefix-router-w2", "prefix-router, 2 workers", "Python",
        "as prefix-router, run as `serve --workers 2`: a supervisor and 2 data-plane"
        " processes on one port (SO_REUSEPORT), in-flight counts shared",
    ),
)  # fmt: skip


WORKERS = {"prefix-router": 1, "prefix-router-w2": 2}  # prefix-router targets: --workers


BY_NAME = {t.name: t for t in TARGETS}


_PEER_ARGS = {"sglang": ("sglang", "cache_aware"), "vllm-ca": ("vllm", "cache_aware"),
              "vllm-ch": ("vllm", "consistent_hash")}  # fmt: skip


_PEER_QUIET = {"sglang": ["--log-level", "warn"], "vllm": ["--log-level", "warning"]}


@dataclass
class Running:
    url: str
    pid: int | None  # the proxy's root process; None for direct
    stop: Callable[[], Awaitable[Any]]
    version: str = ""


@dataclass
class Ctx:
    opt: argparse.Namespace
    tmp: Path
    backends: list[str]
    backend_pid: int
    gen_cpus: set[int] | None
    proxy_cpus: set[int] | None
    use_wrk: bool
    children: list[Child] = field(default_factory=list)
    scripts: dict[str, Path] = field(default_factory=dict)
    requests: dict[str, list[tuple[str, bytes]]] = field(default_factory=dict)
    probe_rate: float | None = None
    baseline: dict[str, dict[str, Any]] = field(default_factory=dict)  # direct's rows


async def version_of(argv: list[str]) -> str:
    """The first line ``argv`` prints (``haproxy -v``, ...), or "?"."""
    try:
        done = await supervisor.run(argv, within=10, cwd=None)
    except (OSError, ChildError):
        return "?"
    text = (done.stdout + done.stderr).strip()
    return text.splitlines()[0] if text else "?"


async def _spawn(ctx: Ctx, name: str, argv: list[str]) -> Child:
    with on_cpu(ctx.proxy_cpus):  # the child inherits this thread's affinity
        return await supervisor.start(ctx.children, name, argv, log=ctx.tmp / f"{name}.log")


async def _until_serving(proc: Child, url: str) -> None:
    """Poll GET /health through the proxy until a backend answers 200."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        with contextlib.suppress(OSError, TimeoutError, ValueError, httptools.HttpParserError):
            if await fetch_json(url, "/_stats") is not None:
                return
        if proc.returncode is not None:
            raise ChildError(f"{proc.name} exited at start-up: {proc.explain()}")
        if time.monotonic() > deadline:
            raise ChildError(f"{proc.name} does not answer on {url}: {proc.explain()}")
        await asyncio.sleep(0.1)


def _haproxy_config(port: int, backends: list[str]) -> str:
    servers = "\n".join(
        f"    server fb-{i} {url.removeprefix('http://')}" for i, url in enumerate(backends)
    )
    return f"""global
    maxconn 8000
    nbthread 1
defaults
    mode http
    option http-buffer-request
    timeout connect 5s
    timeout client 120s
    timeout server 300s
    timeout http-request 10s
    timeout http-keep-alive 75s
frontend bench
    bind 127.0.0.1:{port}
    default_backend fleet
backend fleet
    balance hash req.body,bytes(0,{PREFIX})
    hash-type consistent
    hash-balance-factor 150
{servers}
"""


def _nginx_config(port: int, backends: list[str], tmp: Path) -> str:
    servers = "\n".join(f"        server {u.removeprefix('http://')};" for u in backends)
    return f"""worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
worker_rlimit_nofile 20000;
events {{ worker_connections 10000; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    client_body_buffer_size 128k;   # $request_body exists only for a body held in memory
    client_max_body_size 1m;
    keepalive_requests 1000000;
    keepalive_timeout 75s;
    map $request_body $prefix_key {{
        "~(?s)^(?<head>.{{1,{PREFIX}}})" $head;
        default "";
    }}
    upstream fleet {{
        hash $prefix_key consistent;
{servers}
        keepalive 64;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://fleet;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;        # SSE events go out as they come, as for any LLM proxy
            proxy_read_timeout 300s;
        }}
    }}
}}
"""


async def start_target(ctx: Ctx, target: Target) -> Running:
    name = target.name
    if name == "direct":
        return Running(ctx.backends[0], None, lambda: asyncio.sleep(0))
    if name in _PEER_ARGS:
        key, policy = _PEER_ARGS[name]
        with on_cpu(ctx.proxy_cpus):  # the peer's threads inherit this affinity
            peer = await peers.start_peer(
                key, ctx.backends, venv=ctx.opt.venv, policy=policy, log_dir=ctx.tmp,
                startup_timeout=START_TIMEOUT_S, extra_args=_PEER_QUIET[key],
            )  # fmt: skip
        return Running(peer.url, peer.pid, peer.stop, peers.PINS[key])
    port = supervisor.free_port()
    url = f"http://127.0.0.1:{port}"
    if name == "haproxy":
        cfg = ctx.tmp / "haproxy.cfg"
        cfg.write_text(_haproxy_config(port, ctx.backends))
        proc = await _spawn(ctx, name, ["haproxy", "-db", "-f", str(cfg)])
        await _until_serving(proc, url)
        return Running(url, proc.pid, proc.stop, await version_of(["haproxy", "-v"]))
    if name == "nginx":
        prefix = ctx.tmp / "nginx"
        prefix.mkdir(exist_ok=True)
        prefix.chmod(0o755)  # the worker (nobody) creates its temp paths in it
        ctx.tmp.chmod(0o755)
        conf = prefix / "nginx.conf"
        conf.write_text(_nginx_config(port, ctx.backends, prefix))
        argv = ["nginx", "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "startup.log")]
        proc = await _spawn(ctx, name, argv)
        await _until_serving(proc, url)
        return Running(url, proc.pid, proc.stop, await version_of(["nginx", "-v"]))
    if name == "aiohttp":
        backends = [a for u in ctx.backends for a in ("--backend", u)]
        argv = [sys.executable, "-m", "loadtests.proxybench", "floor",
                "--listen", f"127.0.0.1:{port}", *backends]  # fmt: skip
        proc = await _spawn(ctx, name, argv)
        await _until_serving(proc, url)
        import aiohttp

        return Running(url, proc.pid, proc.stop, f"aiohttp {aiohttp.__version__}")
    if name in WORKERS:
        workers = WORKERS[name]
        backends = [a for i, u in enumerate(ctx.backends) for a in ("--backend", f"fb-{i}={u}")]
        argv = [*SERVE, "--listen", "127.0.0.1:0",
                "--strategy", "prefix", "--prefix-length", str(PREFIX), "--access-log", "off",
                "--admin-listen", "127.0.0.1:0", *backends]  # fmt: skip
        if workers > 1:
            argv += ["--workers", str(workers)]
        # With workers, each logs "listening" when it is up; the supervisor logs
        # "workers listening" once every one of them is.
        event = "listening" if workers == 1 else "workers listening"
        proc = await _spawn(ctx, name, argv)
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
        address = await proc.wait_line(
            lambda line: listening_address(line, event), f"{event!r} log line", deadline
        )
        url = f"http://{address}"
        await _until_serving(proc, url)
        return Running(url, proc.pid, proc.stop, await _git_version())
    raise ChildError(f"unknown target {name}")


PROBLEM_LEVELS = ("warning", "error", "critical")


def log_problems(path: Path) -> list[str]:
    """The lines of a prefix-router log at warning level or above, or not JSON at all
    (a traceback, two processes' lines run together): what went wrong under load."""
    out = []
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except ValueError:
                out.append(line)
                continue
            if not isinstance(event, dict) or event.get("level") in PROBLEM_LEVELS:
                out.append(line)
    return out


async def _git_version() -> str:
    done = await version_of(["git", "-C", str(supervisor.ROOT), "describe", "--always", "--dirty"])
    return f"git {done}"


def availability(opt: argparse.Namespace, names: list[str]) -> dict[str, str | None]:
    """Each selected target: None if it can run here, else why not (after --install)."""
    missing = [binary for binary in APT if shutil.which(binary) is None]
    if missing and opt.install:
        packages = [APT[b] for b in missing]
        say(f"installing with apt-get: {' '.join(packages)}")
        for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *packages]):
            with contextlib.suppress(subprocess.TimeoutExpired):
                subprocess.run(argv, timeout=900, check=False, stdout=subprocess.DEVNULL)
        missing = [binary for binary in APT if shutil.which(binary) is None]
    if missing:
        hint = f"apt-get install {' '.join(APT[b] for b in missing)}, or run with --install"
        say(f"missing: {', '.join(missing)} ({hint})")
    reasons: dict[str, str | None] = {}
    peer_reasons: dict[str, str | None] | None = None
    for name in names:
        reason = None
        if name in ("haproxy", "nginx") and name in missing:
            reason = f"{name} is not installed (apt-get install {name}, or --install)"
        elif name in _PEER_ARGS:
            if peer_reasons is None:
                check = peers.ensure_installed if opt.install else peers.check_installed
                peer_reasons = check(opt.venv)
            reason = peer_reasons.get(_PEER_ARGS[name][0])
            if reason is not None and not opt.install:
                reason += " (run with --install)"
        elif name == "aiohttp":
            with contextlib.suppress(ImportError):
                import aiohttp  # noqa: F401
            reason = None if "aiohttp" in sys.modules else "aiohttp is not importable"
        reasons[name] = reason
    return reasons
