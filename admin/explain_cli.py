"""``prefix-router explain``: the admin API's dry run (``POST /admin/route``) from a shell.

Contract:
- Builds the ``DryRequest`` of a request as a client would send it (method,
  path, ``-H`` headers, the body file's bytes, sent as ``body_base64`` so
  nothing is re-encoded), posts it to a running router's admin API and
  prints the explanation: a few lines for people, or the JSON with
  ``--json``.  The token is the one ``serve`` reads (``--admin-token-file``
  or ``$PREFIX_ROUTER_ADMIN_TOKEN``).
- Exit status: 0 explained, 1 the admin API answered an error (printed), 2
  bad arguments or no admin API to reach.  Blocking stdlib HTTP: a command,
  not the daemon.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any

from router.config import ConfigError

from .auth import load_token

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    explain = sub.add_parser(
        "explain",
        help="dry run: where a request would be routed now, and why (POST /admin/route)",
    )
    explain.add_argument(
        "path", metavar="PATH", help="the request target, e.g. /v1/chat/completions"
    )
    explain.add_argument(
        "body", metavar="BODY", nargs="?", help='a file with the request body, "-" for stdin'
    )
    explain.add_argument("-X", "--method", default="POST", help="the method (POST)")
    explain.add_argument(
        "-H", "--header", action="append", default=[], metavar="'NAME: VALUE'", help="repeatable"
    )
    explain.add_argument("-k", type=int, help="backends of the walk shown (the API's default: 3)")
    explain.add_argument(
        "--admin", default="http://127.0.0.1:9091", metavar="URL", help="the admin API"
    )
    explain.add_argument("--admin-token-file", metavar="FILE")
    explain.add_argument("--json", action="store_true", help="print the JSON answer")


def run(args: argparse.Namespace) -> int:
    try:
        token = load_token(args.admin_token_file, os.environ)
        headers = [_header(text) for text in args.header]
        body = b""
        if args.body == "-":
            body = sys.stdin.buffer.read()
        elif args.body is not None:
            with open(args.body, "rb") as file:
                body = file.read()
    except (ConfigError, ValueError, OSError) as exc:
        print(f"prefix-router explain: {exc}", file=sys.stderr)
        return 2
    dry = {
        "method": args.method,
        "path": args.path,
        "headers": headers,
        "body_base64": base64.b64encode(body).decode(),
    }
    request = urllib.request.Request(
        f"{args.admin.rstrip('/')}/admin/route" + ("" if args.k is None else f"?k={args.k}"),
        data=json.dumps(dry).encode(),
        headers={
            "Content-Type": "application/json",
            **({"Authorization": f"Bearer {token}"} if token else {}),
        },
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        error = json.loads(exc.read() or b"{}").get("error", {})
        print(f"{exc.code}: {error.get('message', exc.reason)}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"prefix-router explain: cannot reach {args.admin}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(answer, indent=2) if args.json else render(answer))
    return 0


def _header(text: str) -> list[str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"a header is 'NAME: VALUE', not {text!r}")
    return [name.strip(), value.strip()]


def render(answer: dict[str, Any]) -> str:
    """The explanation for people: the decision and why, the key, the walk."""
    lines = []
    if answer["backend"] is not None:
        lines.append(f"{answer['backend']}  ({answer['decision']})")
    elif answer["admission"] == "wait":
        lines.append("waits in the admission queue")
    else:
        lines.append(f"answered by the router: {answer['router_answer']}")
    lines.append(f"  why: {answer['reason']}")
    key = answer["key"]
    kind = f"{answer['kind']} {answer['method']} {answer['path']}"
    if key is None:
        lines.append(f"  request: {kind}, no routing key")
    else:
        salt = f", salted by {key['tenant_source']}" if key["tenant_salted"] else ""
        if key["prefix_length"] is None:  # a session key: its whole value
            what = f"{key['content']} {key['session']!r}, {key['length']} {key['unit']}"
        else:
            what = f"{key['content']}, {key['length']} of {key['prefix_length']} {key['unit']}"
        lines.append(
            f"  request: {kind}; key ({key['source']}): {what}{salt}, digest {key['digest']}"
        )
    if answer.get("arm") is not None:
        owns = answer.get("arm_backends")  # Split BACKENDS (router.split)
        on = "" if owns is None else f", on its own {', '.join(owns)}"
        lines.append(f"  arm: {answer['arm']} ({answer['strategy']}){on}")
    if answer["model"] is not None:
        lines.append(f"  model: {answer['model']}, pool {', '.join(answer['pool'] or [])}")
    if answer["response_id"] is not None:
        lines.append(f"  response id: {answer['response_id']} held by {answer['response_backend']}")
    if answer["home"] is not None:
        lines.append(f"  home: {answer['home']}")
    hot = answer["hot_key"]
    if hot is not None:
        lines.append(f"  hot key: {hot['share']} shares, replicas {', '.join(hot['replicas'])}")
    if answer["walk"]:
        lines.append("  walk:")
    for step in answer["walk"]:
        place = "-" if step["position"] is None else str(step["position"])
        counts = f"in flight {step['in_flight']}"
        if step["waiting"] is not None:
            counts += f", waiting {step['waiting']}"
        bounds = f"threshold {step['threshold']}"
        if step["balance_bound"] is not None:
            bounds += f", balance bound {step['balance_bound']}"
        if step["share_bound"] is not None:
            bounds += f", recent {step['recent']} (share bound {step['share_bound']})"
        mark = "eligible" if step["eligible"] else "at its bound"
        if step["state"] != "available":
            mark = step["state"]
        engine = step.get("engine")
        if engine is not None:
            waiting = "?" if engine["waiting"] is None else f"{engine['waiting']:g}"
            kv = engine["kv_cache_usage"]
            kv_text = "?" if kv is None else f"{kv * 100:.0f} %"
            mark += f"; engine: {waiting} waiting, KV {kv_text}, rank {engine['rank']}"
        lines.append(f"    {place:>2} {step['backend']}: {counts}; {bounds}; {mark}")
    if answer.get("without_engine_signals") is not None:
        lines.append(f"  without engine signals: {answer['without_engine_signals']}")
    lines.append(f"  ({answer['view']})")
    return "\n".join(lines)
