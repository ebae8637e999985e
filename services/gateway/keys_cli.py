"""`specd keys create|list|revoke`: the gateway's API keys (services.gateway.keys).

The store is the JSON file given with --keys-file (or SPECD_GATEWAY_KEYS_FILE), else the Redis
given with --redis-url (or SPECD_REDIS_URL): the same the gateway reads. `create` prints the
key once, on stdout (only its SHA-256 digest is stored); `list` prints names, creation times
and limits, never keys or digests; a revoked key is refused by every gateway within
keys.LOOKUP_TTL_S.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from services.common.state import redact_url
from specd.errors import SpecdError


def add_command(sub) -> None:
    k = sub.add_parser("keys", help="create, list or revoke the gateway's API keys",
                       description="API keys of the gateway, in a JSON file (--keys-file) or Redis "
                                   "(--redis-url).")
    which = k.add_subparsers(dest="keys_command", required=True, parser_class=type(k))
    create = which.add_parser("create", help="create a key and print it (once)")
    create.add_argument("name", help="a unique name: 1 to 64 of A-Z a-z 0-9 _ . -")
    create.add_argument("--rpm", type=int, default=0, help="requests per minute (default 0: unlimited)")
    create.add_argument("--tpm", type=int, default=0, help="completion tokens per minute, max_tokens charged "
                                                          "up front (default 0: unlimited)")
    create.add_argument("--concurrent", type=int, default=0, help="requests in flight at once "
                                                                 "(default 0: unlimited)")
    create.set_defaults(func=cmd_create)
    listing = which.add_parser("list", help="names, creation times and limits of the keys")
    listing.add_argument("--json", action="store_true", help="one JSON object per key")
    listing.set_defaults(func=cmd_list)
    revoke = which.add_parser("revoke", help="delete a key: every gateway refuses it within a second")
    revoke.add_argument("name")
    revoke.set_defaults(func=cmd_revoke)
    for p in (create, listing, revoke):
        p.add_argument("--redis-url", default=None, help="Redis holding the keys (default: $SPECD_REDIS_URL)")
        p.add_argument("--keys-file", type=Path, default=None,
                       help="JSON file holding the keys (default: $SPECD_GATEWAY_KEYS_FILE)")


def _store(args: argparse.Namespace):
    from services.gateway.keys import FileKeyStore, RedisKeyStore

    if args.redis_url and args.keys_file:
        raise SpecdError("give --redis-url or --keys-file, not both")
    keys_file = args.keys_file or (None if args.redis_url else os.environ.get("SPECD_GATEWAY_KEYS_FILE"))
    if keys_file:
        return FileKeyStore(keys_file)
    url = args.redis_url or os.environ.get("SPECD_REDIS_URL")
    if url:
        return RedisKeyStore(url, timeout_s=5.0)
    raise SpecdError("where are the keys? give --redis-url URL (or SPECD_REDIS_URL) or --keys-file PATH "
                     "(or SPECD_GATEWAY_KEYS_FILE), as the gateway's")


def _run(args: argparse.Namespace, action) -> int:
    async def go():
        store = _store(args)
        try:
            return await action(store)
        finally:
            await store.close()

    return asyncio.run(go())


def _where(store) -> str:
    return f"keys file {store.path}" if hasattr(store, "path") else f"Redis {redact_url(store.url)}"


def cmd_create(args: argparse.Namespace) -> int:
    from services.gateway.keys import Limits

    if min(args.rpm, args.tpm, args.concurrent) < 0:
        raise SpecdError("--rpm, --tpm and --concurrent must be 0 (unlimited) or more")
    limits = Limits(requests_per_minute=args.rpm, tokens_per_minute=args.tpm,
                    concurrent_requests=args.concurrent)

    async def create(store) -> int:
        key = await store.create(args.name, limits)
        print(key, flush=True)
        print(f"created API key {args.name!r} in {_where(store)} ({_limits(limits)}); this is the only time "
              "it is shown: only its SHA-256 digest is stored", file=sys.stderr)
        return 0

    return _run(args, create)


def cmd_list(args: argparse.Namespace) -> int:
    async def listing(store) -> int:
        records = await store.records()
        if args.json:
            for r in records:
                print(json.dumps(r.model_dump()))
            return 0
        rows = [("NAME", "CREATED (UTC)", "RPM", "TPM", "CONCURRENT")]
        rows += [(r.name, time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.created)),
                  *(str(n or "-") for n in (r.limits.requests_per_minute, r.limits.tokens_per_minute,
                                            r.limits.concurrent_requests))) for r in records]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        return 0

    return _run(args, listing)


def cmd_revoke(args: argparse.Namespace) -> int:
    async def revoke(store) -> int:
        if not await store.revoke(args.name):
            raise SpecdError(f"no API key named {args.name!r} in {_where(store)}")
        print(f"revoked API key {args.name!r}", flush=True)
        return 0

    return _run(args, revoke)


def _limits(limits) -> str:
    parts = [f"{n} {what}" for n, what in ((limits.requests_per_minute, "requests/min"),
                                            (limits.tokens_per_minute, "tokens/min"),
                                            (limits.concurrent_requests, "concurrent")) if n]
    return ", ".join(parts) or "unlimited"
