"""CPU, memory and affinity of process trees, from /proc (Linux only).

Contract: figures cover every process and thread of a tree (reaped children
of its root too, for CPU); ``on_cpu`` pins this thread, and so the children
it starts meanwhile; ``pin_tree`` pins every thread of a running tree.
Nothing here starts or stops a process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
from collections.abc import Iterator

_TICK = os.sysconf("SC_CLK_TCK")


_PAGE = os.sysconf("SC_PAGE_SIZE")


def _stat(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rindex(b")") + 2 :].split()  # [0] is field 3 (state)


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def tree_cpu(root: int) -> float:
    """Seconds of CPU (user + system, all threads) of ``root``'s tree, reaped children too."""
    ticks = 0
    for pid in process_tree(root):
        fields = _stat(pid)
        if fields is not None:
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
            if pid == root:
                ticks += int(fields[13]) + int(fields[14])  # cutime, cstime
    return ticks / _TICK


def tree_rss(root: int) -> int:
    total = 0
    for pid in process_tree(root):
        try:
            with open(f"/proc/{pid}/statm", "rb") as f:
                total += int(f.read().split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            pass
    return total


def pin_tree(root: int, cpus: set[int] | None) -> None:
    """Pin every thread of every process of ``root``'s tree to ``cpus``."""
    if not cpus:
        return
    for pid in process_tree(root):
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), cpus)


@contextlib.contextmanager
def on_cpu(cpus: set[int] | None) -> Iterator[None]:
    """Run this thread, and so the children it starts meanwhile, on ``cpus``."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def self_cpu() -> tuple[float, float]:
    """(this process, its reaped children) CPU seconds: the generator side."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def system_busy() -> tuple[float, float]:
    """CPU seconds all CPUs spent since boot (/proc/stat) in processes, and in interrupts.

    The second figure is mostly the loopback network's softirq work, which the
    kernel (without IRQ time accounting) charges to no process.
    """
    with open("/proc/stat", "rb") as f:
        fields = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + steal) / _TICK, (irq + softirq) / _TICK


class RssPeak:
    """Peak RSS of a process tree, sampled every half second while a run lasts."""

    def __init__(self, pid: int | None):
        self.pid = pid
        self.peak = tree_rss(pid) if pid else 0
        self._task = asyncio.ensure_future(self._sample()) if pid else None

    async def _sample(self) -> None:
        assert self.pid is not None
        while True:
            await asyncio.sleep(0.5)
            self.peak = max(self.peak, tree_rss(self.pid))

    async def stop(self) -> int:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self.peak = max(self.peak, tree_rss(self.pid)) if self.pid else 0
        return self.peak
