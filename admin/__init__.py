"""prefix-router's control plane: the admin REST API (aiohttp) over ``router.control.Control``."""

from .app import AdminServer, make_app
from .auth import load_token, requires_token

__all__ = ["AdminServer", "load_token", "make_app", "requires_token"]
