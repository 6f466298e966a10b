"""Upgrading in place: SIGUSR2 starts the new code, which takes over; and systemd's
notify protocol, so that the service manager follows the process that serves.

Contract:
- ``notify(state)`` sends one ``sd_notify`` datagram (``READY=1``,
  ``MAINPID=N``, ``STOPPING=1``, newline-separated) to ``$NOTIFY_SOCKET`` (a
  path, or ``@name`` in the abstract namespace); without the variable, or if
  the send fails, nothing happens (False).  ``serve`` sends ``READY=1`` with
  its own ``MAINPID`` once everything listens (for a process that took over:
  systemd's main process is then this one, under ``NotifyAccess=all``), and
  ``STOPPING=1`` when a signal stops it (not when it retires after a handover:
  the service goes on).
- ``Upgrade.start()`` (``serve``'s SIGUSR2 handler) runs the command line
  this process was started with (``sys.orig_argv``, the same interpreter;
  the code as it is on disk now) as a child in this process's environment
  and directory, and with its stderr: it takes over through the handover
  socket (``router.handover``) and this process retires.  Without a handover
  socket, or while a child started earlier is still running, it logs why
  and does nothing.  A child that exits before this process retires (a bad
  config on disk, a crash) is reaped and logged; this process goes on
  serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys

from router.log import get_logger

__all__ = ["Upgrade", "notify"]

log = get_logger("upgrade")


def notify(state: str) -> bool:
    """One sd_notify datagram to $NOTIFY_SOCKET; False if unset or not sent."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # the abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            sock.sendto(state.encode(), address)
    except OSError as exc:
        log.warning("systemd notification not sent", state=state, error=str(exc))
        return False
    return True


class Upgrade:
    """SIGUSR2: this command line again, as a child that takes over (the contract)."""

    def __init__(self, handover_socket: str | None):
        self._socket = handover_socket
        # Not asyncio's subprocess: its transport kills a child still running when
        # it is closed, and this child is meant to outlive us.
        self._child: subprocess.Popen[bytes] | None = None
        self._reaper: asyncio.Task[None] | None = None
        self.retired = False  # set by serve once the child (or anyone) took over

    def start(self) -> None:
        if self._socket is None:
            log.warning("SIGUSR2 ignored: no handover_socket to hand over through")
        elif self._child is not None:
            log.warning("SIGUSR2 ignored: the new process is still starting", pid=self._child.pid)
        else:
            argv = [sys.executable, *sys.orig_argv[1:]]
            try:
                # vfork and exec: a millisecond of the loop, not the child's start-up
                self._child = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
            except OSError as exc:
                log.error("upgrade: the new process did not start", error=str(exc))
                return
            log.info("upgrade: new process started", pid=self._child.pid, argv=argv)
            self._reaper = asyncio.create_task(self._reap(self._child))

    async def _reap(self, child: subprocess.Popen[bytes]) -> None:
        """Wait for the child's exit (a pidfd: no poll, no thread) while we serve."""
        loop = asyncio.get_running_loop()
        pidfd = os.pidfd_open(child.pid)
        exited: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(pidfd, readable)
        try:
            await exited
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        code = child.wait()  # exited: at once
        if not self.retired:
            log.error("upgrade: the new process exited before taking over", code=code)
        self._child = None

    async def close(self) -> None:
        """Stop waiting for the child (it outlives us once it took over)."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
