"""Child processes of the load tests: started, watched and stopped in one way.

Contract:
- ``start(children, name, argv)`` runs ``argv`` (in the repository root
  unless ``cwd`` says otherwise) in a session, so a process group, of its own
  (``start_new_session``: uvloop has no ``process_group``): a terminal's
  Ctrl-C reaches only the parent, which then stops each child once.  Had the
  child got the SIGINT too, our SIGTERM could land after its loop removed its
  handlers and kill it mid-exit (seen: -15).  The child is appended to
  ``children`` before any await, so an interrupt still finds it.
- Output, one of two ways.  By default stderr is piped and always drained (a
  full pipe would block the child): each line goes to ``Child.lines`` (None at
  EOF) and the last ``TAIL_LINES`` are kept for error messages; stdout is
  discarded, or piped for the caller with ``stdout=True``.  With ``log=PATH``
  stdout and stderr go to that file and nothing is piped, for benchmarks whose
  measuring loop must not serve a child's output; lines are read back from it.
- ``Child.line(what, deadline)`` is the next output line (stdout with
  ``stdout=True``); ``Child.wait_line(find, what, deadline)`` the first value
  ``find(line)`` returns that is not None.  If the child exits first or
  ``deadline`` (event-loop time) passes, the child is stopped and
  ``ChildError`` says its name, PID, status and last output lines.
- ``Child.stop(grace)`` is SIGTERM to that PID, SIGKILL after ``grace``
  seconds, then reaping (bounded); idempotent; returns the exit status.  Only
  processes started here are signalled, only by their own PID.
- ``run(argv, within)`` is a one-shot child with its output captured, stopped
  the same way if it outlives ``within`` seconds (``ChildError``) or the caller is
  cancelled.
- ``free_port()``: a port of 127.0.0.1 that was free a moment ago.  The child
  binds it later, so another process may take it in between: callers that
  cannot read the child's own address retry on "address in use".
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TypeVar

__all__ = ["ROOT", "Child", "ChildError", "Finished", "free_port", "run", "start"]

ROOT = Path(__file__).resolve().parent.parent
STOP_TIMEOUT_S = 5.0
REAP_TIMEOUT_S = 10.0  # after SIGKILL: the kernel's part, bounded all the same
TAIL_LINES = 20
_POLL_S = 0.05  # reading a log file for a line

T = TypeVar("T")


class ChildError(Exception):
    """A child could not start, exited early or was too slow; the message says which."""


def say(*parts: object) -> None:
    print(*parts, flush=True)  # stdout is a pipe under make and in tests


@dataclass(eq=False)
class Child:
    """A process we started; see the module contract."""

    name: str
    proc: asyncio.subprocess.Process
    log_path: Path | None = None
    tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=TAIL_LINES)
    )
    lines: asyncio.Queue[str | None] = field(default_factory=asyncio.Queue)  # None: EOF
    drain: asyncio.Task[None] | None = None
    _read_at: int = 0  # log mode: bytes of the file already returned as lines

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def last_lines(self, count: int = 15) -> list[str]:
        if self.log_path is None:
            return list(self.tail)[-count:]
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        return text.splitlines()[-count:]

    def explain(self) -> str:
        code = self.proc.returncode
        status = "running" if code is None else f"exit code {code}"
        where = "stderr" if self.log_path is None else f"log ({self.log_path})"
        log = "".join(f"\n    {line}" for line in self.last_lines()) or " (none)"
        return f"{self.name} (pid {self.pid}, {status}); its last {where} lines:{log}"

    async def stop(self, grace: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, SIGKILL after ``grace`` seconds; reaped. Idempotent. The exit status."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            try:
                async with asyncio.timeout(grace):
                    await self.proc.wait()
            except TimeoutError:
                say(f"{self.name} (pid {self.pid}) ignored SIGTERM; killing it")
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                async with asyncio.timeout(REAP_TIMEOUT_S):
                    await self.proc.wait()
        if self.drain is not None:
            await self.drain  # reaches EOF now that the process is gone
        return self.proc.returncode

    async def line(self, what: str, deadline: float, stdout: bool = False) -> str:
        """The next output line; ChildError (the child stopped) if it exits or is too slow."""
        budget = deadline - asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout_at(deadline):
                if stdout:
                    assert self.proc.stdout is not None, "started without stdout=True"
                    line = (await self.proc.stdout.readline()).decode() or None
                elif self.log_path is not None:
                    line = await self._log_line()
                else:
                    line = await self.lines.get()
        except TimeoutError:
            await self.stop()
            raise ChildError(f"no {what} within {budget:.0f} s: {self.explain()}") from None
        if line is None:
            await self.stop()  # reaps it, and its output is complete
            raise ChildError(f"{self.name} exited before {what}: {self.explain()}")
        return line

    async def wait_line(
        self, find: Callable[[str], T | None], what: str, deadline: float, stdout: bool = False
    ) -> T:
        """The first ``find(line)`` that is not None, over the lines still to come."""
        while True:
            found = find(await self.line(what, deadline, stdout))
            if found is not None:
                return found

    async def _log_line(self) -> str | None:
        assert self.log_path is not None
        while True:
            exited = self.proc.returncode is not None  # before reading: no line is lost
            with self.log_path.open("rb") as f:
                f.seek(self._read_at)
                data = f.readline()
            if data.endswith(b"\n") or (exited and data):
                self._read_at += len(data)
                return data.decode(errors="replace").rstrip("\n")
            if exited:
                return None
            await asyncio.sleep(_POLL_S)


async def start(
    children: list[Child],
    name: str,
    argv: Sequence[str],
    *,
    cwd: Path | None = ROOT,
    env: Mapping[str, str] | None = None,
    stdout: bool = False,
    log: Path | None = None,
) -> Child:
    """Start ``argv`` as described in the module contract; registered in ``children`` at once."""
    pipe, devnull = asyncio.subprocess.PIPE, asyncio.subprocess.DEVNULL
    out: IO[bytes] | None = log.open("wb") if log is not None else None
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=cwd, env=env, stdin=devnull, start_new_session=True,
            stdout=out if out is not None else (pipe if stdout else devnull),
            stderr=subprocess.STDOUT if out is not None else pipe,
        )  # fmt: skip
    finally:
        if out is not None:
            out.close()  # the child has its own descriptor
    child = Child(name, proc, log_path=log)
    children.append(child)  # no await since the fork: an interrupt still finds it
    if out is None:

        async def drain() -> None:
            assert proc.stderr is not None
            async for raw in proc.stderr:
                child.tail.append(raw.decode(errors="replace").rstrip())
                child.lines.put_nowait(child.tail[-1])
            child.lines.put_nowait(None)

        child.drain = asyncio.create_task(drain())
    return child


@dataclass(frozen=True)
class Finished:
    returncode: int
    stdout: str
    stderr: str


async def run(argv: Sequence[str], within: float, *, cwd: Path | None = ROOT) -> Finished:
    """Run ``argv`` to its end, output captured; stopped (ChildError) past ``within`` s."""
    pipe = asyncio.subprocess.PIPE
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=cwd, stdin=asyncio.subprocess.DEVNULL, stdout=pipe, stderr=pipe,
        start_new_session=True,
    )  # fmt: skip
    child = Child(Path(argv[0]).name, proc)
    try:
        async with asyncio.timeout(within):
            out, err = await proc.communicate()
    except TimeoutError:
        await child.stop()
        raise ChildError(f"{' '.join(argv[:4])} ... did not finish within {within:g} s") from None
    except BaseException:
        await child.stop()
        raise
    assert proc.returncode is not None
    return Finished(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
