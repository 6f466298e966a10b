"""wrk as the throughput generator: a Lua script cycling prebuilt requests.

Contract: ``wrk_script`` embeds every body with its session header and a
``done`` hook that prints one ``PROXYBENCH {json}`` summary line;
``run_wrk`` runs ``wrk -t1`` as a supervised one-shot child and reads that
line.  Its P50/P99 are wrk's own (1 µs bins), not ``router.metrics.percentile``.
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import supervisor
from ..supervisor import ChildError
from .client import GenStats
from .procfs import on_cpu

_WRK_DONE = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('PROXYBENCH {"requests":%d,"duration_us":%d,"bytes":%d,'
    .. '"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d,'
    .. '"p50_us":%.0f,"p90_us":%.0f,"p99_us":%.0f}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write,
    e.status, e.timeout, latency:percentile(50), latency:percentile(90),
    latency:percentile(99)))
end
"""


def wrk_script(path: str, requests: list[tuple[str, bytes]]) -> str:
    lines = ["local bodies = {}", "local sessions = {}"]
    for i, (session, body) in enumerate(requests, 1):
        text = body.decode()
        if "]=====]" in text:
            raise ValueError("a body contains the Lua long-string terminator")
        lines.append(f"bodies[{i}] = [=====[{text}]=====]")
        lines.append(f'sessions[{i}] = "{session}"')
    lines.append(
        f"""
local reqs = {{}}
local n = 0
init = function(args)
  for i = 1, #bodies do
    local h = {{}}
    h["Content-Type"] = "application/json"
    h["x-session-id"] = sessions[i]
    reqs[i] = wrk.format("POST", "{path}", h, bodies[i])
  end
end
request = function()
  n = n % #reqs + 1
  return reqs[n]
end
"""
    )
    return "\n".join(lines) + _WRK_DONE


async def run_wrk(
    url: str, script: Path, seconds: float, connections: int, cpus: set[int] | None
) -> GenStats:
    argv = [
        "wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", "10s",
        "-s", str(script), url,
    ]  # fmt: skip
    with on_cpu(cpus):  # the thread that starts wrk: it inherits the affinity
        done = await supervisor.run(argv, within=seconds + 60, cwd=None)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("PROXYBENCH ")), None)
    if line is None:
        raise ChildError(f"wrk printed no summary: {(done.stdout + done.stderr)[-500:]}")
    data = json.loads(line.removeprefix("PROXYBENCH "))
    errors = data["connect"] + data["read"] + data["write"] + data["timeout"]
    return GenStats(
        requests=data["requests"],
        errors=errors,
        bad_status=data["status"],
        seconds=data["duration_us"] / 1e6,
        bytes=data["bytes"],
        p50_ms=round(data["p50_us"] / 1000, 3),
        p99_ms=round(data["p99_us"] / 1000, 3),
        generator="wrk",
    )
