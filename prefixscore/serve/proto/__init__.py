"""The gRPC API's schema: prefixscore.proto, and prefixscore_pb2 (its message classes).

prefixscore_pb2 is generated, by `regenerate()` below (grpcio-tools), but not as protoc's
--python_out writes it: protoc's module refuses to import under a protobuf runtime older than the
generator (ValidateProtobufRuntimeVersion), and the runtime where the server runs is whatever
came with it. Ours holds the compiled FileDescriptorProto and builds the classes from it at import
(descriptor_pool + message_factory), which any protobuf >= 4.21 can do. No _pb2_grpc module
either (it pins a grpcio version): grpc_server.py registers its handlers itself.

After editing prefixscore.proto:

    python -c "from prefixscore.serve.proto import regenerate; regenerate()"

tests/serve/test_grpc.py checks that the committed descriptor matches the .proto.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

PROTO = Path(__file__).with_name("prefixscore.proto")
ROOT = PROTO.parents[3]  # the repository: the .proto's name is its path from there
NAME = PROTO.relative_to(ROOT).as_posix()  # prefixscore/serve/proto/prefixscore.proto


def compile_descriptor() -> bytes:
    """prefixscore.proto compiled by grpcio-tools' protoc: a serialized FileDescriptorProto
    (without source info, deterministic)."""
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "set.pb")
        rc = protoc.main(["protoc", f"-I{ROOT}", f"--descriptor_set_out={out}", NAME])
        if rc != 0:
            raise RuntimeError(f"protoc failed on {NAME} (exit {rc}); its errors are above")
        fds = descriptor_pb2.FileDescriptorSet.FromString(Path(out).read_bytes())
    (fd,) = fds.file
    return fd.SerializeToString(deterministic=True)


TEMPLATE = '''"""prefixscore.v1 message classes. Generated from {name} by
prefixscore.serve.proto.regenerate() (grpcio-tools {tools}): do not edit.

Built at import from the compiled descriptor (works on any protobuf runtime >= 4.21; see
prefixscore/serve/proto/__init__.py for why this is not protoc's own _pb2 output)."""
from google.protobuf import descriptor_pool as _descriptor_pool
from google.protobuf import message_factory as _message_factory

SERIALIZED = (
{chunks}
)

_pool = _descriptor_pool.Default()
_pool.AddSerializedFile(SERIALIZED)
DESCRIPTOR = _pool.FindFileByName({name!r})


def _message(name):
    desc = DESCRIPTOR.message_types_by_name[name]
    if hasattr(_message_factory, "GetMessageClass"):  # protobuf >= 4.22
        return _message_factory.GetMessageClass(desc)
    return _message_factory.MessageFactory(_pool).GetPrototype(desc)


{classes}
'''


def regenerate() -> Path:
    """Rewrite prefixscore_pb2.py from prefixscore.proto (needs grpcio-tools)."""
    from importlib.metadata import version

    from google.protobuf import descriptor_pb2

    data = compile_descriptor()
    fd = descriptor_pb2.FileDescriptorProto.FromString(data)
    chunks = "\n".join(f"    {c!r}" for c in _lines(data, 92))
    classes = "\n".join(f"{m.name} = _message({m.name!r})" for m in fd.message_type)
    text = TEMPLATE.format(name=NAME, tools=version("grpcio-tools"), chunks=chunks, classes=classes)
    path = PROTO.with_name("prefixscore_pb2.py")
    path.write_text(text)
    return path


def _lines(data: bytes, width: int) -> list[bytes]:
    """data cut into pieces whose repr fits in width characters."""
    out, start = [], 0
    while start < len(data):
        end = start + 1
        while end < len(data) and len(repr(data[start:end + 1])) <= width:
            end += 1
        out.append(data[start:end])
        start = end
    return out
