"""The one build step pyproject.toml cannot declare: generating the protobuf and gRPC modules.

They are not committed, so every build makes them from protos/**/*.proto with grpcio-tools, a
build requirement pinned beside the protobuf runtime that loads the code it generates. They are
written next to their .proto files (in place), so wheels, sdists and editable installs all have
them; `make proto` runs this same step.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import ClassVar

from setuptools import Command, setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist
from setuptools.errors import ExecError

ROOT = Path(__file__).resolve().parent


class BuildProtos(Command):
    description = "generate the *_pb2.py, *_pb2.pyi and *_pb2_grpc.py modules in place"
    user_options: ClassVar[list[tuple[str, str | None, str]]] = []

    def initialize_options(self) -> None:
        """No options."""

    def finalize_options(self) -> None:
        """No options."""

    def run(self) -> None:
        from grpc_tools import protoc

        sources = sorted(str(path) for path in (ROOT / "protos").rglob("*.proto"))
        well_known = resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
        outputs = [f"--{kind}_out={ROOT}" for kind in ("python", "pyi", "grpc_python")]
        if protoc.main(["protoc", f"-I{ROOT}", f"-I{well_known}", *outputs, *sources]) != 0:
            raise ExecError(f"grpc_tools.protoc failed on {sources}")


class BuildPyWithProtos(build_py):
    """build_py, which an editable install runs too, after generating the modules."""

    def run(self) -> None:
        self.run_command("build_protos")
        super().run()


class SdistWithProtos(sdist):
    """An sdist holds the generated modules like the wheel does."""

    def run(self) -> None:
        self.run_command("build_protos")
        super().run()


setup(
    cmdclass={"build_protos": BuildProtos, "build_py": BuildPyWithProtos, "sdist": SdistWithProtos}
)
