"""pip install . : the attnoracle package (python/attnoracle) with what CMake builds into it: the
native module _attnoracle, the attnoracle command (bin/attnoracle, run by the `attnoracle`
script) and the core vector set (vectors/core). Release build, no tests and no benchmarks;
CMAKE_BUILD_PARALLEL_LEVEL sets the job count, and CMake takes a compiler launcher such as ccache
from CMAKE_CXX_COMPILER_LAUNCHER when it is set."""

import os
import re
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def version():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        return re.search(r"project\(attnoracle VERSION ([0-9.]+)", f.read()).group(1)


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        target = os.path.abspath(self.get_ext_fullpath(ext.name))
        package = os.path.dirname(target)
        build = os.path.abspath(os.path.join(self.build_temp, "cmake"))
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        subprocess.run(["cmake", "-S", ROOT, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DATTNORACLE_TESTS=OFF",
                        "-DATTNORACLE_BENCHMARKS=OFF", "-DATTNORACLE_PYTHON=ON",
                        f"-DPython_EXECUTABLE={sys.executable}"], check=True)
        subprocess.run(["cmake", "--build", build, "--target", "attnoracle_python", "attnoracle", "-j", jobs],
                       check=True)
        built = os.path.join(build, "python", "attnoracle")
        module = next(n for n in os.listdir(built) if n.startswith("_attnoracle.") and n.endswith(".so"))
        os.makedirs(package, exist_ok=True)
        shutil.copy2(os.path.join(built, module), target)
        os.makedirs(os.path.join(package, "bin"), exist_ok=True)
        shutil.copy2(os.path.join(build, "attnoracle"), os.path.join(package, "bin", "attnoracle"))
        vectors = os.path.join(package, "vectors", "core")
        shutil.rmtree(vectors, ignore_errors=True)
        shutil.copytree(os.path.join(ROOT, "vectors", "core"), vectors)


setup(
    name="attnoracle",
    version=version(),
    description="certified reference and conformance gate for attention",
    python_requires=">=3.9",
    install_requires=["numpy"],
    packages=["attnoracle"],
    package_dir={"": "python"},
    ext_modules=[Extension("attnoracle._attnoracle", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    entry_points={
        "console_scripts": ["attnoracle = attnoracle._cli:main"],
        # named as the module, so that `-p attnoracle.pytest_plugin` and conftest's pytest_plugins
        # find it registered already
        "pytest11": ["attnoracle.pytest_plugin = attnoracle.pytest_plugin"],
    },
    options={"build": {"build_base": "build-pip"}},
    zip_safe=False,
)
