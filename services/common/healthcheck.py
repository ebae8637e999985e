"""A probe for container health checks: exit status 0 when a service is healthy, 1 when not.

    python -m services.common.healthcheck grpc HOST:PORT   # standard gRPC health check answers SERVING
    python -m services.common.healthcheck http URL         # GET URL answers 200
"""

from __future__ import annotations

import argparse
import asyncio
import sys

TIMEOUT_S = 3.0


def grpc_healthy(address: str, timeout_s: float = TIMEOUT_S) -> bool:
    """True when the gRPC service at address answers SERVING for the overall service ("")."""
    from services.common.server import check_health

    try:
        return asyncio.run(check_health(address, timeout_s))
    except Exception:  # noqa: BLE001 - a probe reports any failure as unhealthy
        return False


def http_healthy(url: str, timeout_s: float = TIMEOUT_S) -> bool:
    """True when GET url answers 200."""
    import httpx

    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.common.healthcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    sub.add_parser("grpc", help="standard gRPC health check").add_argument("address", help="HOST:PORT")
    sub.add_parser("http", help="HTTP GET answering 200").add_argument(
        "url", help="e.g. http://127.0.0.1:8000/health")
    args = parser.parse_args(argv)
    ok = grpc_healthy(args.address) if args.mode == "grpc" else http_healthy(args.url)
    if not ok:
        print(f"unhealthy: {args.mode} {getattr(args, 'address', None) or args.url}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
