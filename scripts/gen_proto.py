"""Regenerate the coordinator's gRPC stubs from ftjax/coordinator/coordinator.proto, or check them.

    python scripts/gen_proto.py           # rewrite ftjax/coordinator/coordinator_pb2{.py,.pyi,_grpc.py}
    python scripts/gen_proto.py --check   # exit 1 if the committed stubs do not match the .proto

The .proto is compiled with the repository root as include path, so the generated gRPC module
imports its messages as `from ftjax.coordinator import coordinator_pb2`, which works wherever
`ftjax` is importable.

--check always compares what matters (the compiled descriptor of the .proto, and the RPC paths in
the gRPC module); it also compares the files byte for byte when the installed grpcio-tools is the
version that generated them (another version writes other version strings into the same code).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import sys
import tempfile

from google.protobuf import descriptor_pb2

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTO = "ftjax/coordinator/coordinator.proto"
# The .pyi types the messages for mypy (protoc's generated module builds its classes at run time).
OUTPUTS = (
    "ftjax/coordinator/coordinator_pb2.py",
    "ftjax/coordinator/coordinator_pb2_grpc.py",
    "ftjax/coordinator/coordinator_pb2.pyi",
)


def _protoc(out_dir: str, descriptor_out: str | None = None) -> None:
    from grpc_tools import protoc

    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")  # well-known types
    args = ["grpc_tools.protoc", f"-I{REPO}", f"-I{include}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}"]
    args.append(f"--pyi_out={out_dir}")
    if descriptor_out:
        args.append(f"--descriptor_set_out={descriptor_out}")
    args.append(os.path.join(REPO, PROTO))
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {PROTO}")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _strip_json_names(file: descriptor_pb2.FileDescriptorProto) -> None:
    def strip(message: descriptor_pb2.DescriptorProto) -> None:
        for field in message.field:
            field.ClearField("json_name")
        for nested in message.nested_type:
            strip(nested)

    for message in file.message_type:
        strip(message)


def generate() -> None:
    """Write fresh stubs next to the .proto."""
    with tempfile.TemporaryDirectory() as tmp:
        _protoc(tmp)
        for rel in OUTPUTS:
            text = _read(os.path.join(tmp, rel))
            with open(os.path.join(REPO, rel), "w", encoding="utf-8") as f:
                f.write(text)
            print(f"wrote {rel}")


def check() -> list[str]:
    """Problems that make the committed stubs stale (empty list: up to date)."""
    problems: list[str] = []
    missing = [rel for rel in OUTPUTS if not os.path.exists(os.path.join(REPO, rel))]
    if missing:
        return [f"missing {rel}" for rel in missing]
    with tempfile.TemporaryDirectory() as tmp:
        desc_path = os.path.join(tmp, "proto.desc")
        _protoc(tmp, desc_path)
        fresh = descriptor_pb2.FileDescriptorSet.FromString(open(desc_path, "rb").read()).file[0]
        # Loaded from its file (not imported) so that a stale module already imported elsewhere in
        # this process does not hide the committed text.
        committed_pb2 = _load(os.path.join(REPO, OUTPUTS[0]), "_committed_coordinator_pb2")
        committed = descriptor_pb2.FileDescriptorProto.FromString(committed_pb2.DESCRIPTOR.serialized_pb)
        _strip_json_names(fresh)  # descriptor sets carry json_name; the generated module does not
        if committed != fresh:
            problems.append(f"{OUTPUTS[0]} was not generated from the current {PROTO}")
        grpc_text = _read(os.path.join(REPO, OUTPUTS[1]))
        for service in fresh.service:
            for method in service.method:
                path = f"/{fresh.package}.{service.name}/{method.name}"
                if path not in grpc_text:
                    problems.append(f"{OUTPUTS[1]} lacks the RPC {path}")
        if "from ftjax.coordinator import coordinator_pb2" not in grpc_text:
            problems.append(f"{OUTPUTS[1]} does not import `from ftjax.coordinator import coordinator_pb2`")
        match = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", grpc_text)
        installed = importlib.metadata.version("grpcio-tools")
        if match and match.group(1) == installed:
            for rel in OUTPUTS:
                if _read(os.path.join(tmp, rel)) != _read(os.path.join(REPO, rel)):
                    problems.append(f"{rel} differs from what grpcio-tools {installed} generates")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that the committed stubs are current")
    args = parser.parse_args(argv)
    if not args.check:
        generate()
        return 0
    problems = check()
    for problem in problems:
        print(f"stale: {problem}", file=sys.stderr)
    if problems:
        print("run: python scripts/gen_proto.py", file=sys.stderr)
        return 1
    print("coordinator stubs are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
