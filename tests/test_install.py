"""specd as a user installs it: the wheel, built from what the CPU image copies, installed with
--no-deps into a fresh virtual environment outside the checkout (as deploy/docker/Dockerfile
does), runs `specd generate` and `specd serve target` on a tiny model with the default
`--linear-kernels auto`. `make test` installs specd editable, which reads every file from the
checkout, so only an installed copy shows a file the wheel left out. The dependencies come
from this interpreter's site-packages through PYTHONPATH: nothing is downloaded."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from services.cli import free_port
from services.common.server import check_health
from specd.runtime import rows
from tests.deploy.test_manifests import instructions

pytestmark = [pytest.mark.external, pytest.mark.slow]  # pip, a venv and real `specd` processes

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
STARTUP_TIMEOUT_S = 120.0
UNAVAILABLE = "few-row CPU product unavailable"  # specd.runtime.rows' warning when auto falls back
WHERE = ("import json, specd, services, clients; "
         "print(json.dumps([specd.__file__, services.__file__, clients.__file__]))")
SHIPPED_PROMQL = ("from services.common.dashboards import alert_expressions, dashboard_expressions; "
                  "print(len(dashboard_expressions()), len(alert_expressions()))")


def image_sources(into: Path) -> Path:
    """The files the CPU image copies, laid out as it lays them out (its COPY steps), in `into`:
    the wheel is built from them, so the image's `pip install --no-deps .` gets the same package."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for op, arg in instructions(DOCKERFILE.read_text()):
        if op != "COPY":
            continue
        *sources, dest = arg.split()
        for source in map(Path, sources):
            target = into / (source.name if dest.endswith("/") else dest)
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, target, ignore=ignore)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / source, target)
    return into


def run(argv: list, env: dict, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in argv], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=False)
    command = " ".join(map(str, argv))
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


class Installed:
    """specd installed from its wheel into a fresh venv under `root`; `env` sees this
    interpreter's dependencies but not the checkout, and a cache dir of its own."""

    def __init__(self, root: Path):
        assert not root.resolve().is_relative_to(ROOT)
        self.root, self.venv = root, root / "venv"
        src, dist = image_sources(root / "src"), root / "dist"
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
        run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", dist, src], os.environ,
            root)
        (wheel,) = dist.glob("specd-*.whl")
        run([sys.executable, "-m", "venv", "--without-pip", self.venv], os.environ, root)
        run([*pip, "--python", self.python, "install", "--no-deps", "--no-index", wheel], os.environ, root)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SPECD_", "VIRTUAL_ENV"))}
        deps = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
        # Directories on PYTHONPATH are not site dirs: their .pth files (this checkout's editable
        # finder among them) are not run, so `specd` can only come from the new venv.
        env.update(PYTHONPATH=os.pathsep.join(deps), PYTHONNOUSERSITE="1", SPECD_CACHE_DIR=str(root / "cache"))
        env["PATH"] = os.pathsep.join([str(self.venv / "bin"), env.get("PATH", "")])
        self.env = env

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def run(self, *argv) -> subprocess.CompletedProcess:
        """A command run from outside the checkout (its own directory), as a user would."""
        return run(list(argv), self.env, self.root)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    return Installed(tmp_path_factory.mktemp("install"))


def test_the_installed_package_is_whole(installed):
    for path in json.loads(installed.run(installed.python, "-c", WHERE).stdout):
        assert Path(path).resolve().is_relative_to(installed.venv.resolve()), path
    counts = installed.run(installed.python, "-c", SHIPPED_PROMQL).stdout.split()  # dashboard, alert rules
    assert len(counts) == 2 and all(int(n) > 0 for n in counts)


def test_installed_specd_generates_and_serves(installed, tiny_dirs):
    """`specd serve target` and `specd generate` started together, as a user's first two commands
    may be: one of them builds the few-row product (auto) from the installed source, the other
    waits for it and loads it."""
    target_dir = tiny_dirs[0]
    port = free_port()
    log = installed.root / "target.log"
    with open(log, "w") as out:
        target = subprocess.Popen(["specd", "serve", "target", "--model", str(target_dir),
                                   "--port", str(port), "--metrics-port", "0", "--threads", "1",
                                   "--linear-kernels", "auto"],
                                  env=installed.env, cwd=installed.root, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        done = installed.run("specd", "generate", "hello", "--target-model", target_dir, "--device", "cpu",
                             "--linear-kernels", "auto", "--max-new-tokens", "8", "--json")
        assert json.loads(done.stdout)["token_ids"]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not asyncio.run(check_health(f"127.0.0.1:{port}")):
            assert target.poll() is None, f"the target exited {target.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"no health in {STARTUP_TIMEOUT_S:.0f} s:\n{log.read_text()}"
            time.sleep(0.25)
    finally:
        target.send_signal(signal.SIGINT)
        try:
            target.wait(20)
        except subprocess.TimeoutExpired:
            target.kill()
            target.wait()
    if rows.compiler() is not None:  # neither fell back: the operator built once, from the wheel's source
        for output in (done.stderr, log.read_text()):
            assert UNAVAILABLE not in output, output
        assert len(list((Path(installed.env["SPECD_CACHE_DIR"]) / "ops").glob("rows_linear-*.so"))) == 1
