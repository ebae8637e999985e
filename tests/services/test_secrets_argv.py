"""Secrets stay out of argv: `specd serve` refuses one written on its command line (every user
of the machine reads argv) and takes it from a file or the environment; `specd up` hands its
children a Redis URL through the environment; logs never show a Redis password."""

from __future__ import annotations

import argparse
import sys

import pytest

from services.cli import _secrets_to_env, _settings, secret_from_argv
from services.common.state import has_password, redact_url
from specd.errors import SpecdError


def _gateway_args(**given) -> argparse.Namespace:
    from services.common.settings import GatewaySettings

    return argparse.Namespace(**{f: given.get(f) for f in GatewaySettings.model_fields})


@pytest.mark.parametrize("field,value", [("auth_token", "s3cret"), ("api_keys", "sk-a,sk-b"),
                                         ("redis_url", "redis://:pw@127.0.0.1:6379/0"),
                                         ("redis_url", "redis://127.0.0.1:6379/0?password=pw")])
def test_a_secret_on_the_command_line_is_refused_naming_the_flag_and_the_way_out(field, value):
    with pytest.raises(SpecdError) as e:
        _settings("gateway", _gateway_args(**{field: value}))
    flag = "--" + field.replace("_", "-")
    assert str(e.value).startswith(flag + ":") and "@FILE" in str(e.value) and "SPECD_" in str(e.value)
    assert value not in str(e.value)


def test_a_secret_from_a_file_or_a_url_without_password_is_taken(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    s = _settings("gateway", _gateway_args(auth_token=f"@{token}", redis_url="redis://127.0.0.1:6379/0"))
    assert s.auth_token.get_secret_value() == "s3cret" and s.redis_url == "redis://127.0.0.1:6379/0"
    with pytest.raises(SpecdError, match="--auth-token: cannot read"):
        secret_from_argv("auth_token", f"@{tmp_path / 'missing'}")


def test_up_passes_its_redis_url_to_children_in_their_environment():
    flags, env = _secrets_to_env(["--drafter", "ngram", "--redis-url", "redis://:pw@r:6379/0", "--insecure", "true"])
    assert flags == ["--drafter", "ngram", "--insecure", "true"]
    assert env["SPECD_REDIS_URL"] == "redis://:pw@r:6379/0" and env["PATH"]
    assert _secrets_to_env(["--port", "1"])[0] == ["--port", "1"]


def test_redis_passwords_are_redacted_wherever_they_sit():
    assert redact_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("redis://h:6379/0?password=pw&db=1") == "redis://h:6379/0?password=***&db=1"
    assert redact_url("redis://u:pw@[::1]:6379/0?PASSWORD=x") == "redis://u:***@[::1]:6379/0?PASSWORD=***"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
    assert has_password("redis://h/0?password=pw") and has_password("redis://:pw@h/0")
    assert not has_password("redis://h:6379/0?db=2")


def test_serve_refuses_before_loading_anything(tmp_path):
    import subprocess

    r = subprocess.run([sys.executable, "-m", "specd", "serve", "gateway", "--auth-token", "s3cret"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--auth-token: a secret on the command line" in r.stderr, r.stderr
    assert "s3cret" not in r.stderr
