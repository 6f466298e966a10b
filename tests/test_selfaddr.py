"""``router/selfaddr.py``: is a backend address one of the router's own listeners?

On data alone (no listener is opened): the tests listen on 127.0.0.1 only, so a
listener on every address is given as data.  What the admin API and start-up
do with the answer is in ``tests/test_control_live.py``.
"""

from __future__ import annotations

import socket

import pytest

from router.selfaddr import Listener, own_listener

try:
    with open("/proc/sys/net/ipv4/ip_nonlocal_bind") as file:
        NONLOCAL_BIND = file.read().strip()  # "1": any address can be bound, ours or not
except OSError:
    NONLOCAL_BIND = "unknown"


def own_address() -> str | None:
    """This host's address on its default route (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("198.51.100.1", 9))  # TEST-NET-2: only the route is looked up
        except OSError:
            return None
        address = str(sock.getsockname()[0])
    return None if address.startswith("127.") else address


@pytest.mark.parametrize("bound", ["0.0.0.0", "::"])
async def test_a_listener_on_every_address_is_reached_by_every_local_address(bound: str) -> None:
    # own_listener on data alone: the tests listen on 127.0.0.1 only.
    listeners = [Listener("client listener", bound, 8080)]
    for host in ["127.0.0.1", "127.9.9.9", "localhost", "::1", "0.0.0.0", "::", own_address()]:
        if host is not None:
            assert await own_listener(host, 8080, listeners) == listeners[0], host
    assert await own_listener("127.0.0.1", 8081, listeners) is None  # another port
    assert await own_listener("no-such-host.invalid", 8080, listeners) is None  # unresolved
    if NONLOCAL_BIND == "0":
        # Not this host's: binding to it fails, so it is someone else.
        assert await own_listener("198.51.100.7", 8080, listeners) is None
