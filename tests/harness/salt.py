"""What the cache-salt tests share: the secret, one document, a client and a turn that
says how many tokens the engine served from its cache."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import openai

MODEL = "sim-llama-3.1-70b"
SECRET = b"0123456789abcdef-router-secret"
DOCUMENT = "The launch manual of ACME Rockets, chapter one. " * 60  # ~720 tokens


def salt_of(tenant: str) -> str:
    return hmac.new(SECRET, tenant.encode(), hashlib.sha256).hexdigest()


def client(port: int, **options: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, **options
    )


async def cached_tokens(
    via: openai.AsyncOpenAI, tenant: str, headers: dict[str, str] | None = None, **extra: Any
) -> int:
    """One chat turn of ``tenant`` (its prompt_cache_key) on DOCUMENT: tokens served from cache."""
    completion = await via.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": DOCUMENT}, {"role": "user", "content": "Hi"}],
        max_tokens=2,
        extra_body={"prompt_cache_key": tenant, **extra},
        extra_headers=headers,
    )
    assert completion.usage is not None
    assert completion.usage.prompt_tokens_details is not None
    return completion.usage.prompt_tokens_details.cached_tokens or 0
