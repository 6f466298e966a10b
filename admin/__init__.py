"""prefix-router's control plane: the admin REST API (aiohttp) over ``router.control.Control``."""
