"""Builds gradcomp._C by driving the project's CMake build; keeps no source lists of its own."""
import os
import shlex
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(os.environ.get("GRADCOMP_BUILD_DIR", ROOT / "build-python")).resolve()
        cfg = os.environ.get("GRADCOMP_BUILD_TYPE", "Release")
        args = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DCMAKE_BUILD_TYPE={cfg}",
            "-DGRADCOMP_BUILD_TORCH=ON", "-DGRADCOMP_BUILD_TESTS=OFF", "-DGRADCOMP_BUILD_BENCHMARKS=OFF",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DGRADCOMP_PYTHON_OUTPUT_DIR={out_dir}",
        ]
        if "CMAKE_CUDA_ARCHITECTURES" in os.environ:
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={os.environ['CMAKE_CUDA_ARCHITECTURES']}")
        # Extra CMake options, e.g. GRADCOMP_CMAKE_ARGS="-DGRADCOMP_WITH_CUDA=OFF" for a CPU-only build.
        args += shlex.split(os.environ.get("GRADCOMP_CMAKE_ARGS", ""))
        subprocess.check_call(args)
        jobs = os.environ.get("GRADCOMP_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", "gradcomp_torch", "-j", jobs])


setup(
    ext_modules=[CMakeExtension("gradcomp._C")],
    cmdclass={"build_ext": CMakeBuild},
    package_dir={"": "python"},
    packages=["gradcomp", "gradcomp.integrations"],
)
