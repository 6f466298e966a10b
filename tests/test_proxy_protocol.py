"""``proxy_protocol = true``: the client's address from an L4 proxy's PROXY header
(``router/proxyproto.py``, ``router/admission.py``).

The parser against the specification's examples, cut anywhere and fuzzed; then
the router over loopback sockets: the header's address is what
``X-Forwarded-For`` and ``[limits] client_connections`` see, a header may come
in pieces and share a read with the request, ``LOCAL`` keeps the socket's
address, and a client that speaks HTTP straight to the port, sends a broken
header or stalls in one is answered (400, 408) and closed, with nothing left
counted.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.proxyproto import V1_MAX, V2_MAX, V2_SIGNATURE, ProxyHeaderError, parse
from tests.harness.backends import StartBackend
from tests.harness.http import WAIT, Client, assert_error, connect, quiet, req, until
from tests.harness.processes import spawn_router, stop
from tests.harness.routers import StartRouter

pytestmark = pytest.mark.timeout(60)

REQUEST = req(b"GET", b"/health")


def v2(source: str, *, command: int = 1, family: int | None = None, tlvs: bytes = b"") -> bytes:
    """A version 2 header from ``source`` (to 192.0.2.1 or 2001:db8::1, port 443)."""
    if ":" in source:
        block = socket.inet_pton(socket.AF_INET6, source) + socket.inet_pton(
            socket.AF_INET6, "2001:db8::1"
        )
        family = 0x21 if family is None else family
    else:
        block = socket.inet_pton(socket.AF_INET, source) + socket.inet_pton(
            socket.AF_INET, "192.0.2.1"
        )
        family = 0x11 if family is None else family
    block += struct.pack("!HH", 51_000, 443) + tlvs
    return V2_SIGNATURE + bytes([0x20 | command, family]) + struct.pack("!H", len(block)) + block


def v1(source: str) -> bytes:
    if ":" in source:
        return b"PROXY TCP6 %s 2001:db8::1 51000 443\r\n" % source.encode()
    return b"PROXY TCP4 %s 192.0.2.1 51000 443\r\n" % source.encode()


# -- the parser ----------------------------------------------------------------------

HEADERS = [
    (v1("203.0.113.7"), b"203.0.113.7"),
    (v1("2001:db8::7"), b"2001:db8::7"),
    (b"PROXY TCP6 2001:0db8:0:0::07 2001:db8::1 1 2\r\n", b"2001:db8::7"),  # written canonically
    # As version 2 and the socket write it (str() says ::ffff:cb00:7107 before 3.13).
    (b"PROXY TCP6 ::ffff:203.0.113.7 2001:db8::1 1 2\r\n", b"::ffff:203.0.113.7"),
    (v2("::ffff:203.0.113.7"), b"::ffff:203.0.113.7"),
    (b"PROXY UNKNOWN\r\n", None),
    (b"PROXY UNKNOWN ffff:f...f:ffff ffff:f...f:ffff 65535 65535\r\n", None),
    (v2("203.0.113.7"), b"203.0.113.7"),
    (v2("2001:db8::7"), b"2001:db8::7"),
    # AWS NLB's TLV 0xEA (the VPC endpoint's id) and a CRC32C TLV: read past.
    (
        v2("198.51.100.9", tlvs=b"\xea\x00\x17\x01vpce-08d2bf15fac5001c9\x03\x00\x04abcd"),
        b"198.51.100.9",
    ),
    (v2("203.0.113.7", command=0), None),  # LOCAL: the proxy's own connection
    (V2_SIGNATURE + b"\x21\x00\x00\x00", None),  # PROXY, UNSPEC
    (V2_SIGNATURE + b"\x21\x31\x00\xd8" + bytes(216), None),  # a Unix socket's paths
]


@pytest.mark.parametrize(("header", "address"), HEADERS)
def test_a_header_is_read_whole_and_only_once_complete(
    header: bytes, address: bytes | None
) -> None:
    request = b"GET / HTTP/1.1\r\n"
    assert parse(header + request) == (len(header), address)
    for cut in range(1, len(header)):
        assert parse(header[:cut]) is None, cut


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "expected a PROXY protocol header"),
        (b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2\n", "bare LF"),
        (b"PROXY TCP5 1.2.3.4 5.6.7.8 1 2\r\n", "TCP4|TCP6"),
        (b"PROXY TCP4 1.2.3.4 5.6.7.8 1\r\n", "TCP4|TCP6"),
        (b"PROXY TCP4  1.2.3.4 5.6.7.8 1 2\r\n", "TCP4|TCP6"),
        (b"PROXY TCP4 2001:db8::1 5.6.7.8 1 2\r\n", "not an IPv4 address"),
        (b"PROXY TCP6 1.2.3.4 2001:db8::1 1 2\r\n", "not an IPv6 address"),
        (b"PROXY TCP4 1.2.3.004 5.6.7.8 1 2\r\n", "not an address"),
        (b"PROXY TCP4 1.2.3.4 5.6.7.8 65536 2\r\n", "not a port"),
        (b"PROXY TCP4 1.2.3.4 5.6.7.8 -1 2\r\n", "not a port"),
        # A zone holds any byte but a space: CR or a comma into X-Forwarded-For.
        (b"PROXY TCP6 fe80::1%\rX-Evil:1 ::1 1 2\r\n", "a zone"),
        (b"PROXY TCP6 fe80::1%,6.6.6.6 ::1 1 2\r\n", "a zone"),
        (V2_SIGNATURE + b"\x11\x11\x00\x0c" + bytes(12), "version 1 command 1"),
        (V2_SIGNATURE + b"\x22\x11\x00\x0c" + bytes(12), "command 2"),
        (V2_SIGNATURE + b"\x21\x11\x00\x08" + bytes(8), "8 bytes of addresses, 12 needed"),
        (V2_SIGNATURE + b"\x21\x12\x00\x0c" + bytes(12), "DGRAM"),
        (V2_SIGNATURE + b"\x21\x11\xff\xff", f"over {V2_MAX}"),
    ],
)
def test_what_is_not_a_header_is_refused_with_the_reason(data: bytes, says: str) -> None:
    with pytest.raises(ProxyHeaderError, match=r"(?s).*" + says.replace("|", r"\|")):
        parse(data)


def test_a_version_1_line_is_refused_at_its_bound_not_later() -> None:
    line = b"PROXY UNKNOWN " + b"x" * (V1_MAX - 14)
    assert parse(line[:-1]) is None
    with pytest.raises(ProxyHeaderError, match="without CRLF"):
        parse(line)


@given(st.binary(max_size=300))
def test_any_bytes_are_a_header_a_beginning_or_an_error(data: bytes) -> None:
    try:
        found = parse(data)
    except ProxyHeaderError:
        return
    if found is not None:
        size, address = found
        assert 0 < size <= len(data)
        assert address is None or address.decode("ascii")


# -- the router ----------------------------------------------------------------------


async def test_the_headers_address_is_the_client_and_the_request_is_served(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec], proxy_protocol=True)
    async with connect(router) as client:
        await client.send(v1("203.0.113.7") + REQUEST)  # in one write with the request
        assert (await client.response()).status == 200
        await client.send(REQUEST)  # the header was for the connection, not the request
        assert (await client.response()).status == 200
    async with connect(router) as client:
        await client.send_bytewise(v2("2001:db8::7"))  # a byte per read
        await client.send(REQUEST)
        assert (await client.response()).status == 200
    async with connect(router) as client:
        await client.send(v2("203.0.113.7", command=0) + REQUEST)  # LOCAL: the socket's
        assert (await client.response()).status == 200
    forwarded = [seen.value("x-forwarded-for") for seen in backend.requests]
    assert forwarded == [b"203.0.113.7", b"203.0.113.7", b"2001:db8::7", b"127.0.0.1"]
    await until(lambda: router.admission.clients == 0)


async def test_client_connections_counts_the_headers_address_not_the_proxys(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    limits = {"client_connections": 1}
    router = await start_router([backend.spec], proxy_protocol=True, limits=limits)
    async with connect(router) as first, connect(router) as second:
        # Two clients behind one proxy address: each has its own count.
        await first.send(v1("203.0.113.7") + REQUEST)
        await second.send(v2("198.51.100.9") + REQUEST)
        assert (await first.response()).status == 200
        assert (await second.response()).status == 200
        async with connect(router) as third:
            await third.send(v1("203.0.113.7"))  # the first one's address again
            resp = await third.response()
            assert "[limits] client_connections" in assert_error(resp, 429)["message"]
        assert router.admission.by_address == {b"203.0.113.7": 1, b"198.51.100.9": 1}
    await until(lambda: not router.admission.by_address and router.admission.clients == 0)


async def refused(client: Client, status: int) -> str:
    """The error ``client`` got and read to the close: its message."""
    resp = await client.response()
    message = assert_error(resp, status)["message"]
    assert resp.value("connection") == b"close"
    assert await client.rest() == b""
    return str(message)


async def test_http_straight_to_the_port_a_bad_header_or_a_stall_is_refused_and_uncounted(
    backends: StartBackend, start_router: StartRouter, tmp_path: Path
) -> None:
    backend = await backends()
    timeouts = {"client_header": 0.5}
    log = tmp_path / "access.log"
    router = await start_router(
        [backend.spec], proxy_protocol=True, timeouts=timeouts, access_log=str(log)
    )
    async with connect(router) as client:
        await client.send(REQUEST)  # no header: told so at once, not at a timeout
        message = await refused(client, 400)
        assert "expected a PROXY protocol header (proxy_protocol = true)" in message
        assert "GET /health" in message
    async with connect(router) as client:
        await client.send(b"PROXY TCP4 203.0.113.7 nowhere 1 2\r\n" + REQUEST)
        assert "'nowhere' is not an address" in await refused(client, 400)
    async with connect(router) as client:
        await client.send(v2("203.0.113.7")[:20])  # part of one, then nothing
        assert await refused(client, 408) == "PROXY protocol header not received in time"
    async with connect(router) as client:  # nothing at all: closed as an idle connection
        async with asyncio.timeout(WAIT):
            assert await client.reader.read() == b""
    assert router.recorder.refused[400] == 2
    assert router.recorder.refused[408] == 1
    assert backend.requests == []
    await until(lambda: router.admission.clients == 0)
    async with connect(router) as client:  # and the port still serves
        await client.send(v1("203.0.113.7") + REQUEST)
        assert (await client.response()).status == 200
    await quiet(router)
    assert router.access.sync()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    # A refusal names the socket's address (the proxy's: no header was read), a
    # request the address its header named.
    assert [(line["event"], line["status"], line["client"]) for line in lines] == [
        ("refused", 400, "127.0.0.1"),
        ("refused", 400, "127.0.0.1"),
        ("refused", 408, "127.0.0.1"),
        ("access", 200, "203.0.113.7"),
    ]
    # The answers quote the client's bytes; the log keeps a fixed reason.
    assert [line.get("reason") for line in lines[:2]] == ["malformed PROXY protocol header"] * 2


def test_proxy_protocol_with_tls_cert_is_refused_in_the_config() -> None:
    from router.config import ConfigError, build_config

    data = {"proxy_protocol": True, "tls_cert": "c.pem", "tls_key": "k.pem"}
    with pytest.raises(ConfigError, match="terminate TLS at the proxy"):
        build_config(data)


async def test_serve_with_two_workers_reads_the_header_in_each(
    backends: StartBackend, tmp_path: Path
) -> None:
    backend = await backends()
    proc, port = await spawn_router(
        "--backend", f"b0={backend.url}", "--workers", "2", "--proxy-protocol"
    )
    try:
        sources = [f"203.0.113.{n}" for n in range(1, 9)]
        for source in sources:  # the kernel spreads the connections over both workers
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(v1(source) + REQUEST)
            async with asyncio.timeout(WAIT):
                head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
            writer.close()
        forwarded = [seen.value("x-forwarded-for") for seen in backend.requests]
        assert sorted(f or b"" for f in forwarded) == sorted(s.encode() for s in sources)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(REQUEST)
        async with asyncio.timeout(WAIT):
            answer = await reader.read()
        body = json.loads(answer.partition(b"\r\n\r\n")[2])
        assert "PROXY protocol" in body["error"]["message"]
        writer.close()
    finally:
        await stop(proc)


HAPROXY_CONFIG = """\
global
  log stderr format raw local0 warning
defaults
  mode tcp
  timeout connect 5s
  timeout client 30s
  timeout server 30s
frontend v2
  bind fd@{v2_fd}
  default_backend router_v2
frontend v1
  bind fd@{v1_fd}
  default_backend router_v1
backend router_v2
  server router 127.0.0.1:{port} send-proxy-v2
backend router_v1
  server router 127.0.0.1:{port} send-proxy
"""


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="HAProxy is not installed")
async def test_behind_a_real_haproxy_each_client_is_told_apart(
    backends: StartBackend, start_router: StartRouter, tmp_path: Path
) -> None:
    backend = await backends()
    router = await start_router(
        [backend.spec], proxy_protocol=True, limits={"client_connections": 1}
    )
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]  # HAProxy's, passed
    config = tmp_path / "haproxy.cfg"
    fds = [s.fileno() for s in listeners]
    config.write_text(HAPROXY_CONFIG.format(v2_fd=fds[0], v1_fd=fds[1], port=router.port))
    proc = await asyncio.create_subprocess_exec(
        "haproxy", "-db", "-f", str(config), pass_fds=fds, stderr=asyncio.subprocess.PIPE
    )
    try:
        ports = [s.getsockname()[1] for s in listeners]
        for s in listeners:
            s.close()  # HAProxy holds them now

        async def through(port: int, source: str) -> Client:
            sock = socket.socket()
            sock.bind((source, 0))
            sock.setblocking(False)
            async with asyncio.timeout(WAIT):
                await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
                return Client(*await asyncio.open_connection(sock=sock))

        first = await through(ports[0], "127.0.0.5")  # send-proxy-v2
        second = await through(ports[1], "127.0.0.6")  # send-proxy (v1)
        for client in (first, second):
            await client.send(REQUEST)
            assert (await client.response()).status == 200
        third = await through(ports[1], "127.0.0.5")  # the first one's address: past its limit
        await third.send(REQUEST)
        assert_error(await third.response(), 429)
        for client in (first, second, third):
            client.writer.close()
        forwarded = [seen.value("x-forwarded-for") for seen in backend.requests]
        assert forwarded == [b"127.0.0.5", b"127.0.0.6"]
        await until(lambda: not router.admission.by_address)
    finally:
        proc.kill()
        await proc.wait()


async def test_shutdown_serves_a_header_that_comes_in_time_and_closes_the_silent(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec], proxy_protocol=True)
    async with connect(router) as waiting, connect(router) as partial:
        header = v1("203.0.113.7")
        await partial.send(header[:10])
        await until(lambda: len(router.admission.awaiting) == 2)
        stopping = asyncio.create_task(router.shutdown(grace=WAIT))
        await until(lambda: router.stopping)
        # Its header was on its way: the rest of it and a request are served, saying close.
        await partial.send(header[10:] + REQUEST)
        answer = await partial.response()
        assert (answer.status, answer.value("connection")) == (200, b"close")
        async with asyncio.timeout(WAIT):
            # The silent one has what is left of client.STOPPING_IDLE_SECONDS, then it
            # is closed as an idle one is; then the drain is over.
            assert await waiting.rest() == b""
            await stopping
    await until(lambda: router.admission.clients == 0)
    assert not router.admission.awaiting
    assert router.active == 0
