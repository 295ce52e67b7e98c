"""The generated protobuf code is current, package-relative, and registered under shoal/."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]
GENERATED = ROOT / "rpc_agent" / "_generated"


def test_generated_code_matches_the_proto(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
        check=True, capture_output=True, timeout=60,
    )
    fresh = {p.name: p.read_text() for p in tmp_path.iterdir() if p.is_file()}
    current = {p.name: p.read_text() for p in GENERATED.iterdir() if p.is_file()}
    assert sorted(fresh) == sorted(current), "run: python scripts/gen_proto.py"
    stale = [name for name in fresh if fresh[name] != current[name]]
    assert not stale, f"rpc_agent/_generated is stale ({stale}); run: python scripts/gen_proto.py"


def test_generated_modules_import_package_relative_and_avoid_bare_names():
    from shoal.rpc_agent._generated import rpc_pb2
    from shoal.rpc_agent._generated import rpc_pb2_grpc

    assert rpc_pb2.DESCRIPTOR.name == "shoal/rpc.proto"
    assert rpc_pb2.DESCRIPTOR.package == "shoal.rpc"
    assert rpc_pb2_grpc.shoal_dot_rpc__pb2 is rpc_pb2
    assert "from . import rpc_pb2" in (GENERATED / "rpc_pb2_grpc.py").read_text()
    assert not any(p.stem == "proto" for p in GENERATED.iterdir())
    frame = rpc_pb2.Frame(kind=rpc_pb2.CALL, request_id=7, context_id=3, function="m.f")
    assert rpc_pb2.Frame.FromString(frame.SerializeToString()).context_id == 3
    assert not rpc_pb2.Frame().HasField("context_id")
