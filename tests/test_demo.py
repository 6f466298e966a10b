"""``loadtests/demo.py`` (``make demo``) as a user runs it: real subprocesses on loopback.

Asserts orderings that hold on any machine (PREFIX_AWARE's hit rate above
RANDOM's), never wall-clock figures; and that every process the demo starts is
gone when it exits: after a run, after SIGTERM, after a terminal's Ctrl-C (SIGINT
to the whole process group). Each test stays well under 30 s.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 25.0  # per phase; a compare run takes ~3 s on 2 busy cores
PID = re.compile(r"\bpid (\d+)")
ROUTER_LINE = re.compile(r"at (http://127\.0\.0\.1:\d+) +\(pids: fleet (\d+), router (\d+)\)")


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def finish(proc: asyncio.subprocess.Process, within: float) -> tuple[str, str]:
    """Wait for the demo's end; if it overruns, SIGTERM it (it stops its children) and fail."""
    try:
        async with asyncio.timeout(within):
            out, err = await proc.communicate()
    except TimeoutError:
        proc.terminate()
        out, err = await proc.communicate()
        pytest.fail(f"demo still running after {within} s:\n{out.decode()}\n{err.decode()}")
    return out.decode(), err.decode()


async def test_compare_prints_both_strategies_and_prefix_hits_more() -> None:
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "loadtests.demo", "--requests", "48", "--seed", "3"),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await finish(proc, DEADLINE_S)
    assert proc.returncode == 0, out + err
    rows = {}
    for line in out.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 6 and cells[0] in ("RANDOM", "PREFIX_AWARE"):
            rows[cells[0]] = cells
    assert set(rows) == {"RANDOM", "PREFIX_AWARE"}, out
    for cells in rows.values():
        assert cells[1] == "48"
        assert re.fullmatch(r"\d+(/\d+){3} %", cells[5]), cells
        assert cells[3].endswith(" ms"), cells
        assert cells[4].endswith(" ms"), cells
    random_hits, prefix_hits = (float(rows[s][2].rstrip("%")) for s in ("RANDOM", "PREFIX_AWARE"))
    assert prefix_hits > random_hits, out
    assert "PREFIX_AWARE vs RANDOM: P50 TTFT" in out
    # Is prefix caching on? The instance started without a cache is flagged, sim-0 not.
    assert re.search(r"^  sim-0: ok - ", out, re.M), out
    assert re.search(r"^  sim-nocache: suspect_off - .*--enable-prefix-caching", out, re.M), out
    assert "router log: warning: prefix cache suspect off backend=sim-nocache" in out
    pids = {int(pid) for pid in PID.findall(out)}
    assert len(pids) == 5, out  # the fleet, the no-cache instance and three routers
    assert all(gone(pid) for pid in pids)


MODULE = ("-m", "loadtests.demo", "--serve")
CLI = ("-m", "admin", "demo", "--serve")


@pytest.mark.parametrize(
    ("command", "ctrl_c"),
    [(MODULE, False), (CLI, False), (CLI, True)],
    ids=["module-sigterm", "cli-sigterm", "cli-ctrl-c"],
)
async def test_serve_answers_then_stops_cleanly(command: tuple[str, ...], ctrl_c: bool) -> None:
    """SIGTERM to the top process, or SIGINT to its whole process group as a terminal does."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group, for killpg below
    )
    assert proc.stdout is not None
    seen, match = [], None
    try:
        async with asyncio.timeout(DEADLINE_S):
            async for raw in proc.stdout:
                seen.append(raw.decode())
                if match := ROUTER_LINE.search(seen[-1]):
                    break
        assert match, "".join(seen)
        url, pids = match[1], [int(match[2]), int(match[3])]
        body = {
            "model": "sim-llama-3.1-70b",
            "stream": True,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hello!"}],
        }
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{url}/v1/chat/completions", json=body) as resp,
        ):
            assert resp.status == 200
            assert resp.headers["x-sim-instance"].startswith("sim-")
            text = await resp.text()
        assert text.rstrip().endswith("data: [DONE]")
    finally:
        if proc.returncode is None and ctrl_c:
            os.killpg(proc.pid, signal.SIGINT)
        elif proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        out, err = await finish(proc, DEADLINE_S)
    assert proc.returncode == 0, "".join(seen) + out + err
    assert out.rstrip().endswith("stopped"), out
    assert all(gone(pid) for pid in pids), pids


def test_cli_demo_without_a_clone_says_so(tmp_path: Path) -> None:
    for package in ("router", "hashring", "admin"):  # an install: the packages, no loadtests/
        shutil.copytree(ROOT / package, tmp_path / package)
    done = subprocess.run(
        [sys.executable, "-m", "admin", "demo"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )
    assert done.returncode == 2
    assert "loadtests" in done.stderr


@pytest.mark.parametrize("ctrl_c", [False, True], ids=["sigterm", "ctrl-c"])
async def test_compare_interrupted_mid_run_stops_everything(ctrl_c: bool) -> None:
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "loadtests.demo"),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None
    seen: list[str] = []
    try:
        async with asyncio.timeout(DEADLINE_S):
            async for raw in proc.stdout:  # interrupt once RANDOM's requests are flowing
                seen.append(raw.decode())
                if "--strategy random" in seen[-1]:
                    break
    finally:
        if ctrl_c:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        out, err = await finish(proc, DEADLINE_S)
    output = "".join(seen) + out
    assert proc.returncode == 130, output + err
    assert "interrupted" in out
    pids = {int(pid) for pid in PID.findall(output)}
    # The fleet, the no-cache instance, the first router, and the checking router
    # if it was up first (the two start together).
    assert len(pids) in (3, 4), output
    assert all(gone(pid) for pid in pids), pids
