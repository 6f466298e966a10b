"""``loadtests/supervisor.py``: real child processes started, read and stopped by PID."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from loadtests import supervisor
from loadtests.supervisor import Child, ChildError

READY = "import sys, time; print('ready', file=sys.stderr, flush=True); time.sleep(60)"
SILENT = "import time; time.sleep(60)"
DEAF = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " + READY
SLOW_START_S = 30.0  # a Python child on a busy 2-core machine


@pytest.fixture
async def children() -> AsyncIterator[list[Child]]:
    started: list[Child] = []
    try:
        yield started
    finally:
        for child in started:
            await child.stop(grace=1)


def deadline(seconds: float = SLOW_START_S) -> float:
    return asyncio.get_running_loop().time() + seconds


async def test_waits_for_a_line_then_stops_by_sigterm_once(children: list[Child]) -> None:
    child = await supervisor.start(children, "sleeper", [sys.executable, "-c", READY])
    assert children == [child]
    assert await child.wait_line(lambda line: line or None, "ready", deadline()) == "ready"
    assert os.getpgid(child.pid) == child.pid  # a process group of its own
    assert await child.stop() == -signal.SIGTERM
    assert await child.stop() == -signal.SIGTERM  # idempotent


async def test_kills_a_child_that_ignores_sigterm(children: list[Child]) -> None:
    child = await supervisor.start(children, "deaf", [sys.executable, "-c", DEAF])
    await child.line("ready", deadline())
    assert await child.stop(grace=0.2) == -signal.SIGKILL


async def test_a_log_file_is_read_line_by_line_and_an_early_exit_explained(
    children: list[Child], tmp_path: Path
) -> None:
    code = "print('one'); print('two', flush=True); raise SystemExit(3)"
    log = tmp_path / "child.log"
    child = await supervisor.start(children, "quitter", [sys.executable, "-c", code], log=log)
    assert [await child.line("a line", deadline()) for _ in range(2)] == ["one", "two"]
    with pytest.raises(ChildError, match=r"(?s)quitter exited before a third.*exit code 3.*two"):
        await child.line("a third", deadline())


async def test_a_silent_child_is_stopped_at_the_deadline(children: list[Child]) -> None:
    child = await supervisor.start(children, "mute", [sys.executable, "-c", SILENT])
    with pytest.raises(ChildError, match=r"no greeting within 0 s: mute \(pid \d+, exit code"):
        await child.line("greeting", deadline(0.2))
    assert child.returncode is not None


async def test_run_captures_output_and_stops_what_overruns() -> None:
    done = await supervisor.run([sys.executable, "-c", "print('out')"], within=SLOW_START_S)
    assert (done.returncode, done.stdout) == (0, "out\n")
    with pytest.raises(ChildError, match=r"did not finish within 0\.2 s"):
        await supervisor.run([sys.executable, "-c", SILENT], within=0.2)
