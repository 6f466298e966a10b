"""prefix-router's data plane: an asyncio L7 router that keeps shared prompt
prefixes on the same inference server (see README.md and ../shared/DESIGN.md)."""
