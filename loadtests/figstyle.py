"""What every figure shares: one colour per routing target, and how a PNG is written.

Contract
--------
- ``color(target)`` is a hex colour for a target as the harnesses label it:
  the routing benchmarks' ``Run.target`` (``RANDOM``, ``PREFIX_AWARE TRAFFIC
  PREFILL``, ``sglang-router cache_aware``, ...) and the proxy ladder's labels
  (``HAProxy``, ``prefix-router``, ...). Exact names first, then families
  (every other ``PREFIX_AWARE`` setting is a blue, every other ``sglang`` or
  ``vllm`` target its router's colour), then a fixed cycle for anything else,
  so that a figure never depends on the order its runs came in.
- prefix-router is blue (darkest for the recommended setting; ConcurrencyScope
  PREFILL alone, the setting that hot-spots, rose), the baselines grey and
  purple, the Rust peers orange and green, the C proxies brown: colours from
  Okabe and Ito's and Paul Tol's colour-blind-safe sets.
- ``save(fig, path)`` renders a matplotlib ``Figure`` (no pyplot) at 100 dpi
  and writes it as an 8-bit palette PNG, optimised: a third of the size of
  matplotlib's RGBA output for these flat-coloured charts, so committed
  figures stay well under 100 KB. No software version or date goes into the
  file: the same figure gives the same bytes (with the same matplotlib and
  Pillow).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["DPI", "OURS", "color", "save"]

DPI = 100
# Antialiased text and lines over a few flat colours: 128 palette entries keep
# edges smooth (64 shows banding on the grey grid lines).
COLOURS = 128

# The recommended setting and the ladder's prefix-router share the darkest blue.
OURS = "#0b4f8a"

_EXACT = {
    "RANDOM": "#8c8c8c",
    "LEAST_OUTSTANDING_REQUESTS": "#aa4499",
    "PREFIX_AWARE": "#88ccee",
    "PREFIX_AWARE TRAFFIC": "#3a8fd0",
    "PREFIX_AWARE PREFILL": "#cc6677",
    "PREFIX_AWARE TRAFFIC PREFILL": OURS,
    "prefix-router": OURS,
    # make_figures' routers in front of one fleet: sharing state is the
    # recommended setting working; each its own state is the failure it fixes.
    "routers share state every 0.1 s": OURS,
    "each router its own state": "#cc6677",
    "sglang-router cache_aware": "#e69f00",
    "vllm-router cache_aware": "#009e73",
    "vllm-router consistent_hash": "#7fcdb3",
    "HAProxy": "#8b5a2b",
    "nginx": "#c8a27a",
    "aiohttp floor": "#cc79a7",
    "direct (no proxy)": "#000000",
}
_FAMILIES = (
    ("PREFIX_AWARE", "#1f77b4"),
    ("sglang", "#e69f00"),
    ("vllm", "#009e73"),
)
_CYCLE = ("#d55e00", "#f0e442", "#17becf", "#bcbd22", "#e377c2", "#7f7f7f")


def color(target: str) -> str:
    """The colour of ``target`` (see the module contract)."""
    if target in _EXACT:
        return _EXACT[target]
    for start, value in _FAMILIES:
        if target.startswith(start):
            return value
    # A stable pick for an unknown name: the same name, the same colour, in any run.
    return _CYCLE[sum(target.encode()) % len(_CYCLE)]


def save(fig: Figure, path: Path) -> Path:
    """Write ``fig`` to ``path`` as an optimised palette PNG (see the module contract)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, metadata={"Software": None})
    buffer.seek(0)
    with Image.open(buffer) as image:
        flat = image.convert("RGB").quantize(COLOURS, method=Image.Quantize.MEDIANCUT)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    flat.save(path, format="PNG", optimize=True)
    return path
