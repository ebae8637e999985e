"""scripts/compose_env.py: the .env that docker compose refuses to start without (no default
secrets): generated once, kept on a second run, readable by its owner only."""

from __future__ import annotations

import importlib.util
import stat
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compose_env.py"


def _load():
    spec = importlib.util.spec_from_file_location("compose_env", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


def test_generates_every_secret_compose_needs_once(tmp_path, capsys):
    env = tmp_path / ".env"
    env.write_text("SPECD_REDIS_PASSWORD=mine\n")
    script = _load()
    assert script.main([str(env)]) == 0
    first = _read(env)
    assert first["SPECD_REDIS_PASSWORD"] == "mine"  # a value already there is kept
    assert len(first["GRAFANA_ADMIN_PASSWORD"]) >= 20
    assert first["SPECD_GATEWAY_API_KEYS"].startswith("sk-specd-")
    assert first["SPECD_GATEWAY_API_KEYS"] in capsys.readouterr().out  # shown once, to use it
    assert stat.S_IMODE(env.stat().st_mode) == 0o600
    assert script.main([str(env)]) == 0
    assert _read(env) == first
    assert first["SPECD_GATEWAY_API_KEYS"] not in capsys.readouterr().out
