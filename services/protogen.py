"""Generate the Python gRPC code for protos/ into services/proto/ (`make protos`).

protoc names imports after the .proto paths (`from specd.common.v1 import common_pb2`), which
would land inside the core package `specd`; the generated modules are rewritten to import
from `services.proto.specd...` instead. The output is committed and a test checks it is
current, so an edited .proto without regenerated code fails CI.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT = ROOT / "services" / "proto"
PACKAGE = "services.proto"


def generate(out: Path) -> list[Path]:
    """Write the generated modules under out; returns the files written."""
    from grpc_tools import protoc

    files = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        well_known = Path(protoc.__file__).parent / "_proto"
        args = ["protoc", f"-I{PROTOS}", f"-I{well_known}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}", *files]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(tmp, out)
    written = []
    for path in sorted(out.rglob("*.py*")):
        if path.suffix in (".py", ".pyi"):
            path.write_text(re.sub(r"^from specd\.", f"from {PACKAGE}.specd.", path.read_text(), flags=re.MULTILINE))
            written.append(path)
    for d in [out, *(p for p in out.rglob("*") if p.is_dir())]:
        (d / "__init__.py").touch()
    return written


if __name__ == "__main__":
    print("\n".join(str(p.relative_to(ROOT)) for p in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)))
