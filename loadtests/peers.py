"""Peer routers for comparison benchmarks: sglang-router and vllm-router on loopback.

Contract
--------
- Both peers are Rust routers shipped as PyPI wheels. They live in a venv of their own
  (``.venv-peers`` by default), never in ours: ``ensure_installed(venv)`` creates it with
  the running interpreter, pip installs the pinned versions that are missing, checks that
  each peer answers ``--help``, and returns ``{key: None}`` for a usable peer or
  ``{key: "why not"}``. Every step has a timeout; nothing here waits unbounded.
- ``start_peer(key, worker_urls, venv=..., policy=...)`` runs one peer as a child process
  bound to 127.0.0.1 on a free port, its Prometheus exporter on another free port of
  127.0.0.1, the policy's thresholds at the peer's defaults, and returns a ``RunningPeer``
  once the peer's ``/readiness`` reports every worker registered and healthy. A peer that
  exits, or is not ready within ``startup_timeout``, is stopped and ``PeerError`` says why
  (exit status and the tail of its log).
- ``RunningPeer.stop()`` signals that PID only: SIGTERM, then SIGKILL after a timeout
  (a ``loadtests.supervisor`` child: its own process group, its log in a file).
  ``RunningPeer.stats()`` reads the peer's own Prometheus counters: requests it sent to
  each worker URL.

What the peers do in front of the simulated vLLM fleet (measured by tests/test_peers.py
and by hand; sources cited where they explain it):
- sglang-router 0.3.2 (``sgl-model-gateway``): at start-up, per worker, ``GET /health``,
  an HTTP/2 prior-knowledge (gRPC) probe of the worker port (the sim logs a 400 for it),
  then ``GET /server_info``, ``/get_server_info``, ``/model_info``, ``/get_model_info``.
  vLLM serves none of the last four, so the model id is "unknown" and no tokenizer is
  looked for; it listens before its workers are registered, hence the ``/readiness`` wait.
  Per request it sends only the proxied call. Routing text: the text of the messages
  joined with spaces, roles and template left out (``extract_text_for_routing``,
  sgl-project/sglang ``sgl-router/src/protocols/chat.rs``). The body is re-serialised
  (``max_tokens`` becomes ``max_completion_tokens``; SGLang fields are added).
  Accepted client sockets get no TCP_NODELAY (no ``setsockopt`` on them under strace),
  so on a kept-alive client connection the first SSE event of every streamed response
  after the first waits for the client's delayed ACK: ~40 ms more TTFT on Linux.
- vllm-router 0.1.17: waits for ``GET /health`` of every worker before it listens. With
  ``cache_aware``, every request is first rendered by EVERY worker, ``POST
  /v1/chat/completions/render`` (``/v1/completions/render``), falling back to ``POST
  /tokenize`` with the messages, and the prefix tree is keyed on the returned token ids
  (``token_ids``, or ``tokens``). A worker that serves neither (the sim before it had them)
  makes every decision "missing_tokens", routed least-loaded: affinity is lost without
  an error (measured). ``consistent_hash`` keys on a session header
  (``x-session-id``, ``x-user-id``, ``x-tenant-id``, ``x-correlation-id``,
  ``x-request-id``, ``x-trace-id``) or a ``user``/``session_id`` body field; without one
  the key is constant and every request goes to one worker (vllm-project/router
  ``src/policies/hash_key.rs``).
- Both, cache_aware: a request whose best prefix match is <= ``cache_threshold`` (0.3)
  goes to the worker with the fewest requests in flight, ties to the same worker every
  time, so new prefixes sent one at a time all land on one worker (measured for both);
  affinity yields to load only when max - min in flight > 64 and max > 1.5 x min
  (vllm-project/router ``src/policies/cache_aware.rs``; the same defaults in
  sglang-router's ``--help``).
- Neither contacts anything but the workers (strace: every ``connect`` is to 127.0.0.1);
  ``HF_HUB_OFFLINE`` is set anyway so that no tokenizer download is ever attempted.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from . import supervisor

__all__ = [
    "PEERS",
    "PINS",
    "Peer",
    "PeerError",
    "RunningPeer",
    "check_installed",
    "ensure_installed",
    "start_peer",
]


@dataclass(frozen=True, slots=True)
class Peer:
    """One benchmarked configuration: a peer router and its policy."""

    name: str
    key: str  # "sglang" | "vllm"
    policy: str = "cache_aware"


# The configurations a benchmark runs. consistent_hash is listed because it is vllm-router's
# other affinity policy; without a session header it sends everything to one worker.
PEERS = (
    Peer("sglang-router cache_aware", "sglang"),
    Peer("vllm-router cache_aware", "vllm"),
    Peer("vllm-router consistent_hash", "vllm", "consistent_hash"),
)


@dataclass(frozen=True, slots=True)
class _Spec:
    package: str
    version: str
    module: str  # python -m MODULE --help | --worker-urls ...
    policies: tuple[str, ...]
    counter: str  # Prometheus sample counting requests per worker, label "worker"

    @property
    def pin(self) -> str:
        return f"{self.package}=={self.version}"


# Versions verified on this project's machines (Linux x86_64, CPython 3.11): both wheels
# install into one venv and start in ~0.5 s.
_SPECS = {
    "sglang": _Spec(
        "sglang-router",
        "0.3.2",
        "sglang_router.launch_router",
        ("random", "round_robin", "cache_aware", "power_of_two", "manual"),
        "smg_worker_cb_outcomes_total",  # every outcome of every request sent to a worker
    ),
    "vllm": _Spec(
        "vllm-router",
        "0.1.17",
        "vllm_router.launch_router",
        (
            "random",
            "round_robin",
            "cache_aware",
            "kv_aware",
            "power_of_two",
            "consistent_hash",
            "sticky_least_loaded",
        ),
        "vllm_router_processed_requests_total",
    ),
}
PINS = {key: spec.pin for key, spec in _SPECS.items()}

_PIP_TIMEOUT_S = 900.0
_HELP_TIMEOUT_S = 60.0


class PeerError(RuntimeError):
    """A peer cannot be installed, started or reached; the message says why."""


# ---------------------------------------------------------------- installation


def ensure_installed(venv: Path = Path(".venv-peers")) -> dict[str, str | None]:
    """Make ``venv`` hold both peers at their pinned versions: ``{key: None | reason}``."""
    python = _python(venv)
    if not python.exists():
        done = _run([sys.executable, "-m", "venv", str(venv)], 120.0)
        if done is not None:
            reason = f"cannot create the venv {venv}: {done}"
            return dict.fromkeys(_SPECS, reason)
    missing = [key for key, reason in check_installed(venv).items() if reason is not None]
    reasons: dict[str, str | None] = dict.fromkeys(_SPECS)
    # One resolver run for both; on failure, once each to tell whose install failed.
    if missing and _pip_install(python, [_SPECS[key].pin for key in missing]) is not None:
        for key in missing:
            failure = _pip_install(python, [_SPECS[key].pin])
            if failure is not None:
                reasons[key] = f"pip install {_SPECS[key].pin} failed: {failure}"
    for key, spec in _SPECS.items():
        if reasons[key] is None:
            failure = _run([str(python), "-m", spec.module, "--help"], _HELP_TIMEOUT_S)
            if failure is not None:
                reasons[key] = f"{spec.package} is installed but does not run: {failure}"
    return reasons


def check_installed(venv: Path = Path(".venv-peers")) -> dict[str, str | None]:
    """Like ``ensure_installed`` but installs nothing: ``{key: None | why not}``."""
    python = _python(venv)
    if not python.exists():
        return dict.fromkeys(_SPECS, f"no venv at {venv} (ensure_installed creates it)")
    reasons: dict[str, str | None] = {}
    for key, spec in _SPECS.items():
        version = _installed(python, spec)
        if version == spec.version:
            reasons[key] = None
        elif version is None:
            reasons[key] = f"{spec.package} is not installed in {venv}"
        else:
            reasons[key] = f"{spec.package} {version} is installed in {venv}, not {spec.version}"
    return reasons


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _installed(python: Path, spec: _Spec) -> str | None:
    code = f"import importlib.metadata as m; print(m.version({spec.package!r}))"
    try:
        done = subprocess.run(
            [str(python), "-c", code], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _pip_install(python: Path, pins: list[str]) -> str | None:
    command = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
    return _run([*command, "--retries", "2", "--timeout", "60", *pins], _PIP_TIMEOUT_S)


def _run(command: list[str], timeout: float) -> str | None:
    """None if ``command`` exits 0 within ``timeout``, else a one-line reason."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"`{' '.join(command[:4])} ...` did not finish within {timeout:.0f} s"
    except OSError as exc:
        return f"cannot run {command[0]}: {exc}"
    if done.returncode == 0:
        return None
    lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
    return f"exit status {done.returncode}: {lines[-1] if lines else 'no output'}"


# ---------------------------------------------------------------- running


@dataclass(eq=False)
class RunningPeer:
    """A started peer: ``url`` serves the OpenAI API; ``stop()`` when done."""

    key: str
    policy: str
    url: str
    metrics_url: str
    worker_urls: tuple[str, ...]
    log_path: Path
    startup_s: float  # spawn to ready, every worker registered
    _child: supervisor.Child = field(repr=False)

    @property
    def pid(self) -> int:
        return self._child.pid

    @property
    def name(self) -> str:
        return f"{_SPECS[self.key].package} {self.policy}"

    @property
    def returncode(self) -> int | None:
        return self._child.returncode

    async def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM this PID, SIGKILL it after ``grace`` seconds; idempotent. Its exit status."""
        return await self._child.stop(grace)

    async def metrics(self) -> str:
        """The peer's Prometheus exposition, as text."""
        timeout = aiohttp.ClientTimeout(total=5)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(self.metrics_url) as response,
        ):
            return await response.text()

    async def stats(self) -> dict[str, int]:
        """Requests the peer sent to each worker URL, from its Prometheus counters."""
        text = await self.metrics()
        counts = dict.fromkeys(self.worker_urls, 0)
        sample_name = _SPECS[self.key].counter
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                worker = sample.labels.get("worker")
                if sample.name == sample_name and worker is not None:
                    counts[worker] = counts.get(worker, 0) + int(sample.value)
        return counts

    def log_tail(self, lines: int = 20) -> str:
        return _tail(self.log_path, lines)

    async def __aenter__(self) -> RunningPeer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


async def start_peer(
    key: str,
    worker_urls: Sequence[str],
    *,
    venv: Path = Path(".venv-peers"),
    policy: str | None = None,
    startup_timeout: float = 30.0,
    log_dir: Path | None = None,
    extra_args: Sequence[str] = (),
) -> RunningPeer:
    """Start peer ``key`` in front of ``worker_urls``; return once every worker is ready.

    ``policy`` defaults to cache_aware; ``extra_args`` are appended to the command line
    (thresholds are left at the peer's defaults unless given there). The peer's log goes
    to a file in ``log_dir`` (a new temporary directory by default), kept after ``stop``.
    """
    spec = _SPECS.get(key)
    if spec is None:
        raise ValueError(f"unknown peer {key!r}; known: {', '.join(_SPECS)}")
    policy = policy or "cache_aware"
    if policy not in spec.policies:
        raise ValueError(f"{spec.package} has no policy {policy!r}; it has {spec.policies}")
    if not worker_urls:
        raise ValueError("a peer needs at least one worker URL")
    python = _python(venv)
    if not python.exists():
        raise PeerError(f"{spec.package}: no venv at {venv} (run ensure_installed first)")
    log_dir = Path(tempfile.mkdtemp(prefix=f"peer-{key}-")) if log_dir is None else log_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    # A free port is picked, closed, then bound by the peer: another process can take it in
    # between, which the peer reports as a bind error; a few attempts make that harmless.
    last: PeerError | None = None
    for attempt in range(3):
        log_path = log_dir / f"{key}-{policy}-{attempt}.log"
        try:
            return await _launch(
                spec, key, policy, python, tuple(worker_urls), log_path, startup_timeout, extra_args
            )
        except _PortTaken as exc:
            last = PeerError(str(exc))
    assert last is not None
    raise last


class _PortTaken(PeerError):
    pass


async def _launch(
    spec: _Spec,
    key: str,
    policy: str,
    python: Path,
    worker_urls: tuple[str, ...],
    log_path: Path,
    startup_timeout: float,
    extra_args: Sequence[str],
) -> RunningPeer:
    port, metrics_port = supervisor.free_port(), supervisor.free_port()
    command = [
        str(python),
        "-m",
        spec.module,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        *extra_args,
    ]
    started = time.monotonic()
    children: list[supervisor.Child] = []
    try:
        await supervisor.start(children, key, command, cwd=None, env=_env(), log=log_path)
    except OSError as exc:
        raise PeerError(f"{spec.package}: cannot start {python}: {exc}") from None
    peer = RunningPeer(
        key=key,
        policy=policy,
        url=f"http://127.0.0.1:{port}",
        metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
        worker_urls=worker_urls,
        log_path=log_path,
        startup_s=0.0,
        _child=children[0],
    )
    try:
        await _wait_ready(peer, spec, startup_timeout)
    except BaseException:
        await peer.stop(grace=5)
        raise
    peer.startup_s = time.monotonic() - started
    return peer


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    # Loopback only: no proxy, and no tokenizer or model download from a hub, ever.
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        NO_PROXY="127.0.0.1,localhost",
        NO_COLOR="1",
    )
    return env


async def _wait_ready(peer: RunningPeer, spec: _Spec, within: float) -> None:
    """Poll ``/readiness`` until it counts every worker healthy; both peers serve it."""
    expected = len(peer.worker_urls)
    seen = "no answer yet"
    deadline = time.monotonic() + within
    probe_timeout = aiohttp.ClientTimeout(total=1)
    async with aiohttp.ClientSession(timeout=probe_timeout) as session:
        while True:
            if peer.returncode is not None:
                # Let the log catch up with the exit before quoting it.
                await asyncio.sleep(0.05)
                raise _failure(peer, spec, f"exited with status {peer.returncode}")
            try:
                async with session.get(f"{peer.url}/readiness") as response:
                    body = await response.text()
                    seen = f"/readiness {response.status}: {body[:200]}"
                    if response.status == 200 and _all_ready(body, expected):
                        return
            except (aiohttp.ClientError, TimeoutError) as exc:
                seen = f"/readiness: {type(exc).__name__}"
            if time.monotonic() >= deadline:
                raise _failure(peer, spec, f"not ready within {within:.0f} s (last: {seen})")
            await asyncio.sleep(0.05)


def _all_ready(body: str, expected: int) -> bool:
    try:
        data: Any = json.loads(body)
    except ValueError:
        return False
    return (
        isinstance(data, dict)
        and data.get("healthy_workers") == expected
        and data.get("total_workers") == expected
    )


def _failure(peer: RunningPeer, spec: _Spec, what: str) -> PeerError:
    tail = _tail(peer.log_path, 15)
    message = f"{spec.package} ({peer.policy}) {what}; log {peer.log_path}:\n{tail}"
    if "Address already in use" in tail or "address in use" in tail.lower():
        return _PortTaken(message)
    return PeerError(message)


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    text = _ANSI.sub("", text)  # sglang-router colours its log even into a file
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
