"""The state file: the fleet and routing config the admin API was told about.

Contract:
- ``save`` is atomic and durable: write a temporary file in the same
  directory, fsync it, rename it over the state file, fsync the directory.
  A crash at any point leaves either the old file or the new one, whole.
  A symlinked state file is written through: the temporary file goes next to
  the link's (resolved) target and replaces it, so the link stays a link.
- ``save`` raises ``StateError`` naming the file and the reason (a missing
  directory, a path through a regular file, no space...) when it cannot write;
  the file is then unchanged.  ``check`` tells the same at start-up.
- ``load`` returns None when there is no file, the saved ``State`` when there
  is, and raises ``StateError`` with a clear message when the file cannot be
  read or does not parse: a corrupt state file stops start-up, it is never
  silently replaced (the next save would destroy what it held).
- A floor raised since a value was saved does not make it corrupt: a health
  ``interval`` or ``timeout`` above 0 and below ``HEALTH_FLOOR_S`` (any
  number above 0 was taken before) is raised to the floor, with a warning
  naming the file, the field and both values (``raise_to_floors``, which
  ``router.control.etcd`` applies to the values it reads too).  The file
  keeps the old value until the next change rewrites it.  New values below
  the floor are still refused (the admin API's 422, exit 2 for the config).
- At start-up the state file, when present, wins over the config file and
  the flags for backends and routing (the README says so).
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Any, Literal

import msgspec

from .config import HEALTH_FLOOR_S, BackendSpec, HealthOverride, RoutingConfig
from .log import get_logger
from .slowstart import Ramp

__all__ = ["SavedBackend", "State", "StateError", "StateFile", "raise_to_floors"]

log = get_logger("state")

VERSION = 1


class StateError(Exception):
    """The state file cannot be read, parsed or written."""


class SavedBackend(msgspec.Struct, forbid_unknown_fields=True, frozen=True, omit_defaults=True):
    name: str
    url: str
    weight: int = 1
    state: Literal["active", "draining"] = "active"
    health: HealthOverride | None = None
    models: tuple[str, ...] = ()
    # Its slow start when it was added (router.slowstart): every replica that
    # applies the add ramps it from the same start; one past its end is inert.
    ramp: Ramp | None = None

    @classmethod
    def of(
        cls,
        spec: BackendSpec,
        state: Literal["active", "draining"] = "active",
        weight: int = 0,
        ramp: Ramp | None = None,
    ) -> SavedBackend:
        """``spec`` as saved, in ``state``, with ``weight`` if given (a live change)."""
        weight = weight or spec.weight
        return cls(spec.name, spec.url, weight, state, spec.health, spec.models, ramp)

    def spec(self) -> BackendSpec:
        """The backend as the admin API accepted it (validated again on load)."""
        data = msgspec.to_builtins(self)
        data.pop("state", None)
        data.pop("ramp", None)
        return msgspec.convert(data, BackendSpec)


def raise_to_floors(backend: Any, source: str, path: str = "$") -> None:
    """Raise, in place, a saved backend's (decoded, untyped) health ``interval`` and
    ``timeout`` that are above 0 but below ``HEALTH_FLOOR_S`` to the floor, logging
    each; ``path`` is the backend's place in ``source``.  Anything else is left for
    the typed conversion to accept or refuse."""
    health = backend.get("health") if isinstance(backend, dict) else None
    if not isinstance(health, dict):
        return
    for field in ("interval", "timeout"):
        value = health.get(field)
        if (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and 0 < value < HEALTH_FLOOR_S
        ):
            health[field] = HEALTH_FLOOR_S
            log.warning(
                "saved value below its floor raised to it",
                source=source,
                field=f"{path}.health.{field}",
                old=value,
                new=HEALTH_FLOOR_S,
            )


class State(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    version: int
    backends: list[SavedBackend]
    routing: RoutingConfig = msgspec.field(name="RoutingConfig")


class StateFile:
    __slots__ = ("path",)

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)

    def load(self) -> State | None:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateError(f"cannot read state file {self.path}: {exc.strerror}") from None
        try:
            document = msgspec.json.decode(raw)
            backends = document.get("backends") if isinstance(document, dict) else None
            if isinstance(backends, list):
                source = f"state file {self.path}"
                for index, backend in enumerate(backends):
                    raise_to_floors(backend, source, f"$.backends[{index}]")
            state = msgspec.convert(document, State)
            for saved in state.backends:
                saved.spec()  # the same validation as the API applied when it was saved
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            reason = str(exc) if not isinstance(exc, RecursionError) else "nesting too deep"
            raise StateError(
                f"state file {self.path} is corrupt ({reason}); fix or move it away to start"
                " from the configuration instead"
            ) from None
        if state.version != VERSION:
            raise StateError(f"state file {self.path} has version {state.version}, not {VERSION}")
        return state

    def check(self) -> None:
        """Raise StateError now if the state file's directory is not there to write in."""
        target = self._target()
        if not target.parent.is_dir():
            raise StateError(self._cannot_write(target, errno.ENOENT, "No such file or directory"))
        if target.is_dir():
            raise StateError(f"state file {self._named(target)} is a directory")

    def save(self, state: State) -> None:
        """Replace the state file atomically (blocking: call it from a thread)."""
        target = self._target()
        data = msgspec.json.format(msgspec.json.encode(state), indent=2) + b"\n"
        try:
            self._replace(target, data)
        except OSError as exc:
            raise StateError(self._cannot_write(target, exc.errno, exc.strerror)) from None

    def _target(self) -> Path:
        # os.replace on a symlink would replace the link itself with a regular file
        # and the change would never reach the file the link points to.
        return Path(os.path.realpath(self.path))

    def _named(self, target: Path) -> str:
        return str(self.path) if target == self.path else f"{self.path} (-> {target})"

    def _cannot_write(self, target: Path, code: int | None, reason: str | None) -> str:
        directory = target.parent
        if code in (errno.ENOENT, errno.ENOTDIR) and not directory.is_dir():
            if directory.exists() or directory.is_symlink():
                reason = f"{directory} is not a directory"
            elif code == errno.ENOTDIR:
                reason = f"a part of {directory} is not a directory"
            else:
                reason = f"its directory {directory} does not exist"
        return f"cannot write state file {self._named(target)}: {reason}"

    @staticmethod
    def _replace(target: Path, data: bytes) -> None:
        directory = target.parent
        fd, temp = tempfile.mkstemp(prefix=f".{target.name}.", dir=directory)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temp, target)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
