"""Tenants in the metrics, end to end: the real router (in process, then with
``--workers 2``) in front of simulated instances and hand-written backends.

The component's own bounds (100,000 tenants) are in ``tests/test_tenants.py``;
here a few hundred tenants go through the router and ``/metrics`` must show at
most ``metrics_top + 1`` tenant labels, never a tenant key, and add up.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
import openai
import pytest

from router.app import Router
from router.tenants import OTHER
from tests.harness.backends import StartBackend, echo
from tests.harness.processes import ADMIN_PORTS, spawn_router, stop
from tests.harness.routers import SimFleet, StartRouter

pytestmark = pytest.mark.timeout(120)

MODEL = "sim-llama-3.1-70b"
LABEL = re.compile(r'^prefix_router_tenant_requests_total\{tenant="([^"]*)"\} (\S+)$', re.M)
RETIRED = re.compile(r"^prefix_router_tenant_requests_retired_total (\S+)$", re.M)


def tenant_counts(text: str) -> dict[str, float]:
    return {label: float(value) for label, value in LABEL.findall(text)}


def retired(text: str) -> float:
    found = RETIRED.search(text)
    assert found is not None
    return float(found.group(1))


async def test_a_few_hundred_tenants_show_as_top_n_plus_other(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    sims = await sim_fleet(2)
    router: Router = await start_router(sims, tenants={"metrics_top": 5})
    heavy = [f"heavy-{i}" for i in range(3)]
    sent = 0
    async with openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{router.port}/v1", api_key="unused", max_retries=0
    ) as via:

        async def ask(tenant: str, text: str) -> None:
            await via.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": text}],
                max_tokens=2,
                extra_body={"prompt_cache_key": tenant},
            )

        for round_ in range(10):
            batch = [ask(tenant, f"{tenant} {round_}") for tenant in heavy]
            batch += [ask(f"once-{round_}-{i}", "hello") for i in range(30)]
            await asyncio.gather(*batch)
            sent += len(batch)
    text = router.collector.render().decode()
    counts = tenant_counts(text)
    assert len(counts) <= 5 + 1
    assert OTHER in counts
    for tenant in heavy:
        assert router.tenants._label(tenant) in counts  # the busiest have labels
        assert tenant not in text  # never the key itself
    assert "once-" not in text
    assert sum(counts.values()) + retired(text) == sent
    # The TTFT histogram has the same labels, and counts the requests with a first byte.
    assert f'prefix_router_tenant_ttft_seconds_count{{tenant="{OTHER}"}}' in text


async def test_a_configured_header_names_the_tenant(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends(echo)
    router = await start_router(
        [backend.spec], tenants={"header": "X-Team", "metrics_names": True, "metrics_top": 4}
    )
    async with aiohttp.ClientSession() as http:
        for team in ("search", "search", "ads"):
            async with http.post(
                f"http://127.0.0.1:{router.port}/generate",
                data=b"prompt",
                headers={"X-Team": team, "X-Amzn-SageMaker-Prefix-Aware-Id": "salt"},
            ) as resp:
                assert resp.status == 200
        async with http.post(f"http://127.0.0.1:{router.port}/generate", data=b"p") as resp:
            assert resp.status == 200
    counts = tenant_counts(router.collector.render().decode())
    assert counts == {"search": 2.0, "ads": 1.0, "none": 1.0, OTHER: 0.0}


async def scrape(http: aiohttp.ClientSession, proc: asyncio.subprocess.Process) -> str:
    async with http.get(f"http://127.0.0.1:{ADMIN_PORTS[proc.pid]}/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


async def test_two_workers_merge_into_a_bounded_consistent_view(
    backends: StartBackend, tmp_path: Path
) -> None:
    backend = await backends(echo)
    config = tmp_path / "router.toml"
    config.write_text("[tenants]\nmetrics_top = 3\n")
    proc, port = await spawn_router(
        "--config",
        str(config),
        "--workers",
        "2",
        "--no-health-checks",
        "--backend",
        "{}={}".format(*backend.spec),
    )
    try:
        heavy = ["alpha", "beta", "gamma"]
        sent = 0
        seen: dict[str, float] = {}
        async with aiohttp.ClientSession() as http:

            async def post(tenant: str) -> None:
                async with http.post(
                    f"http://127.0.0.1:{port}/generate",
                    data=f"{tenant} prompt",
                    headers={"X-Amzn-SageMaker-Prefix-Aware-Id": tenant, "Connection": "close"},
                ) as resp:
                    assert resp.status == 200

            for round_ in range(4):
                batch = [post(t) for t in heavy for _ in range(10)]
                batch += [post(f"bomb-{round_}-{i}") for i in range(60)]
                await asyncio.gather(*batch)
                sent += len(batch)
                text = await scrape(http, proc)
                counts = tenant_counts(text)
                assert len(counts) <= 3 + 1
                assert sum(counts.values()) + retired(text) == sent
                assert counts[OTHER] >= seen.get(OTHER, 0)  # other only grows
                seen = counts
            # Read twice without traffic in between: the merged view does not move.
            assert tenant_counts(await scrape(http, proc)) == seen
        assert "alpha" not in text
        assert "bomb-" not in text
        assert len(seen) == 4  # the three heavy tenants and other
    finally:
        await stop(proc)
