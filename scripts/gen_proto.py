"""Generate rpc_agent/_generated/ from proto/shoal/*.proto with grpcio-tools.

    python scripts/gen_proto.py            # rewrite rpc_agent/_generated/
    python scripts/gen_proto.py --out DIR  # write elsewhere (the staleness test compares)

The protos are compiled with `proto/` as the include root, so they register in protobuf's global
pool as `shoal/<name>.proto` (never a bare `rpc.proto`, which the etcd client also registers).
Generated imports are rewritten to package-relative ones so the modules work inside
`rpc_agent._generated` without putting anything on sys.path.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
DEFAULT_OUT = ROOT / "rpc_agent" / "_generated"

INIT_TEXT = '"""Code generated from proto/shoal/*.proto by scripts/gen_proto.py; do not edit."""\n'

# `from shoal import rpc_pb2 as shoal_dot_rpc__pb2` -> `from . import rpc_pb2 as ...`
_ABSOLUTE_IMPORT = re.compile(r"^from shoal import (\w+_pb2)", re.MULTILINE)


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Compile every proto under proto/shoal into `out_dir`; return the files written."""
    from grpc_tools import protoc  # noqa: PLC0415  (a dev dependency, only needed here)

    protos = sorted(PROTO_ROOT.glob("shoal/*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_ROOT / 'shoal'}")
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[str(p.relative_to(PROTO_ROOT)) for p in protos],
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed: {' '.join(args)}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for src in sorted((pathlib.Path(tmp) / "shoal").iterdir()):
            text = _ABSOLUTE_IMPORT.sub(r"from . import \1", src.read_text())
            dst = out_dir / src.name
            dst.write_text(text)
            written.append(dst)
    init = out_dir / "__init__.py"
    init.write_text(INIT_TEXT)
    written.append(init)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.out == DEFAULT_OUT and DEFAULT_OUT.exists():
        # Start clean so a removed .proto leaves no stale module behind.
        for path in DEFAULT_OUT.iterdir():
            if path.is_file():
                path.unlink()
            elif path.name == "__pycache__":
                shutil.rmtree(path)
    for path in generate(args.out):
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
