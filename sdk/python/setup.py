"""Build step of the shardserve Python package: compiles the protocol (proto/shardserve/v1/*.proto
of the repository, or the directory named by SHARDSERVE_PROTO_DIR) with grpcio-tools' protoc into
shardserve/v1/ of the build, with type stubs. Everything else is in pyproject.toml."""
import glob
import os
from importlib import metadata

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def proto_root():
    root = os.environ.get("SHARDSERVE_PROTO_DIR") or os.path.join(HERE, "..", "..", "proto")
    if not glob.glob(os.path.join(root, "shardserve", "v1", "*.proto")):
        raise SystemExit(f"shardserve: no shardserve/v1/*.proto under {os.path.abspath(root)}: build from the "
                         "repository's sdk/python, or set SHARDSERVE_PROTO_DIR to the proto/ directory")
    return root


class BuildWithProtos(build_py):
    """build_py, then protoc --python_out/--pyi_out/--grpc_python_out into the build directory."""

    def run(self):
        super().run()
        from grpc_tools import protoc  # a build requirement
        import importlib.resources

        root = proto_root()
        protos = sorted(glob.glob(os.path.join(root, "shardserve", "v1", "*.proto")))
        well_known = str(importlib.resources.files("grpc_tools") / "_proto")
        out = self.build_lib
        args = ["protoc", f"-I{root}", f"-I{well_known}", f"--python_out={out}", f"--pyi_out={out}",
                f"--grpc_python_out={out}", *protos]
        if protoc.main(args) != 0:
            raise SystemExit(f"shardserve: protoc failed on {protos}")
        package = os.path.join(out, "shardserve", "v1")
        with open(os.path.join(package, "__init__.py"), "w") as f:
            f.write('"""Generated protocol code of shardserve.v1 (made by grpcio-tools at build time)."""\n')


def requirements():
    """grpcio at least as new as the grpcio-tools that generated the stubs (they check it at import),
    and the protobuf runtime range that grpcio-tools' generated code needs."""
    tools = metadata.version("grpcio-tools")
    protobuf = [r for r in (metadata.requires("grpcio-tools") or []) if r.replace(" ", "").startswith("protobuf")]
    return [f"grpcio>={tools}", *(protobuf or ["protobuf"])]


setup(cmdclass={"build_py": BuildWithProtos}, install_requires=requirements())
