"""TLS to ``https://`` backends: one client context per process, built off the loop.

Contract:
- A backend whose url is ``https://HOST[:PORT]`` (port 443 by default) is
  spoken to over TLS: its requests (``router.upstream.Pool``), its health
  checks and its metric scrapes (``router.health``).  The server name sent
  (SNI) and checked against its certificate is the url's host.
  ``http://`` backends are not affected.
- ``[backend_tls]`` (``config.BackendTLS``): ``ca_file``, the PEM bundle the
  backends' certificates chain to (unset: the system's trust store);
  ``verify = false`` takes any certificate for any name (logged as a warning
  at start-up: it is for a test fleet, not for production); ``cert_file`` and
  ``key_file``, the router's client certificate for mutual TLS.
- ``context(config)`` builds the context and raises ConfigError naming the
  file that cannot be loaded; ``serve`` and ``check-config`` call it before
  anything starts when the config names files (``files``; exit 2).
- ``BackendTLS.get()`` is what the data plane awaits: the context is built
  at its first call, in a thread, and kept.  Loading the system's trust
  store is ~65 ms of CPU on this machine: on the loop, the first ``https://``
  backend added through the admin API would hold every request that long, and
  building it in every router, worker or test at start-up costs as much for
  fleets that have no ``https://`` backend at all.  Connections are pooled
  (``upstream_keepalive``), so a handshake is paid once per connection, not
  per request.
- Every process (each worker of ``--workers N``, the supervisor for its
  health checks) builds its own from the same config: the same trust, the
  same client certificate.
- Files that cannot be loaded any more at the first use (removed after
  start-up) are the router's fault: a request gets a 503 that blames no
  backend (as running out of file descriptors does), a health check leaves
  the backend's state as it is, the failure is logged, and the build is
  tried again a second later at the earliest.
"""

from __future__ import annotations

import asyncio
import ssl

from .config import BackendTLS as BackendTLSConfig
from .config import ConfigError
from .log import get_logger

__all__ = ["RETRY_SECONDS", "BackendTLS", "context", "files"]

log = get_logger("router")

RETRY_SECONDS = 1.0  # after a failed build, before the next try


def context(config: BackendTLSConfig) -> ssl.SSLContext:
    """The client-side TLS context for ``https://`` backends (ConfigError naming the
    file if one cannot be loaded)."""
    built = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # names and chains checked
    built.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        if config.ca_file is None:
            built.load_default_certs(ssl.Purpose.SERVER_AUTH)  # the system's: ~65 ms
        else:
            built.load_verify_locations(cafile=config.ca_file)  # these, and only these
        if config.cert_file is not None and config.key_file is not None:
            built.load_cert_chain(config.cert_file, config.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load backend_tls files: {exc}") from None
    if not config.verify:
        built.check_hostname = False
        built.verify_mode = ssl.CERT_NONE
    return built


def files(config: BackendTLSConfig) -> bool:
    """Whether ``config`` names files (``context`` can fail on them)."""
    return config.ca_file is not None or config.cert_file is not None


class BackendTLS:
    """A process's context for ``https://`` backends, built at the first ``get``."""

    __slots__ = ("_building", "_config", "_failed_at", "built")

    def __init__(self, config: BackendTLSConfig):
        self._config = config
        self.built: ssl.SSLContext | None = None
        self._building: asyncio.Future[ssl.SSLContext] | None = None
        self._failed_at = 0.0  # when the last build failed (loop time)

    async def get(self) -> ssl.SSLContext:
        """The context; the first call builds it in a thread (the others wait for it).
        A file that cannot be loaded any more raises ConfigError, the router's fault,
        not a backend's: the data path answers 503 and blames no backend.  A failed
        build is tried again ``RETRY_SECONDS`` later at the earliest, not by every
        request meanwhile (each try is ~65 ms of a thread's CPU)."""
        if self.built is not None:
            return self.built
        loop = asyncio.get_running_loop()
        building = self._building
        if building is None or (building.done() and loop.time() - self._failed_at >= RETRY_SECONDS):
            building = self._building = asyncio.ensure_future(
                asyncio.to_thread(context, self._config)
            )
            building.add_done_callback(self._done)
        self.built = await asyncio.shield(building)
        return self.built

    def _done(self, building: asyncio.Future[ssl.SSLContext]) -> None:
        if building.cancelled() or building.exception() is None:
            return
        self._failed_at = asyncio.get_running_loop().time()
        log.error("backend_tls: cannot build the context", error=str(building.exception()))
