"""Write .env for `docker compose up`: a generated Redis password, Grafana admin password and
first API key, so that no compose deployment runs on a default secret. An existing .env is
kept (values already there are not replaced); the API key is printed once.

    python scripts/compose_env.py && docker compose up --build
    python scripts/compose_env.py PATH     # another file than the repository's .env
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

ENV = Path(__file__).resolve().parents[1] / ".env"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    env = Path(argv[0]) if argv else ENV
    have = {}
    if env.exists():
        for line in env.read_text().splitlines():
            name, sep, value = line.partition("=")
            if sep and not name.lstrip().startswith("#"):
                have[name.strip()] = value
    new = {
        "SPECD_REDIS_PASSWORD": secrets.token_hex(24),
        "GRAFANA_ADMIN_PASSWORD": secrets.token_urlsafe(18),
        # The gateway's first key (a static key: `specd keys create` makes named, limited ones).
        "SPECD_GATEWAY_API_KEYS": "sk-specd-" + secrets.token_urlsafe(32),
    }
    added = {k: v for k, v in new.items() if k not in have}
    if added:
        with env.open("a") as f:
            f.writelines(f"{k}={v}\n" for k, v in added.items())
        os.chmod(env, 0o600)
    for name in new:
        state = "written" if name in added else "kept"
        print(f"{name}: {state} in {env}")
    if "SPECD_GATEWAY_API_KEYS" in added:
        print(f"API key (send it as 'Authorization: Bearer <key>'): {added['SPECD_GATEWAY_API_KEYS']}")
    print(f"Grafana: http://127.0.0.1:3000, user admin, password in {env} (GRAFANA_ADMIN_PASSWORD)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
