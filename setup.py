"""Build of the cattention extension.

OpenMP is probed by compiling and running a tiny program; without it the
extension is built serial with a loud warning (CATTENTION_REQUIRE_OPENMP=1
makes that an error, for wheel builds). The default build targets the
baseline instruction set of the platform: faster kernels are compiled with
per-function target attributes and chosen at run time, so the build never
targets the build machine's CPU, and no option relaxes IEEE semantics
(masked logits are -inf and NaN must propagate).
"""

import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

OPENMP_TEST = r"""
#include <omp.h>
#include <stdio.h>
int main(void) {
    int n = 0;
    #pragma omp parallel reduction(+:n)
    n += 1;
    printf("%d\n", n > 0);
    return 0;
}
"""


def openmp_flags(compiler):
    """(compile_args, link_args) that build and run an OpenMP program, or None."""
    cc = compiler.compiler_so[0] if hasattr(compiler, "compiler_so") else "cc"
    candidates = [(["-fopenmp"], ["-fopenmp"])]
    if sys.platform == "darwin":
        candidates.append((["-Xpreprocessor", "-fopenmp"], ["-lomp"]))
    tmp = tempfile.mkdtemp(prefix="cattention-omp-")
    try:
        src = os.path.join(tmp, "omp_test.c")
        exe = os.path.join(tmp, "omp_test")
        with open(src, "w") as f:
            f.write(OPENMP_TEST)
        for cflags, lflags in candidates:
            cmd = [cc, *cflags, src, "-o", exe, *lflags]
            try:
                subprocess.run(cmd, check=True, capture_output=True)
                result = subprocess.run([exe], check=True, capture_output=True, text=True)
            except (OSError, subprocess.CalledProcessError):
                continue
            if result.stdout.strip() == "1":
                return cflags, lflags
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class BuildExt(build_ext):
    def build_extensions(self):
        flags = openmp_flags(self.compiler)
        if flags is None:
            if os.environ.get("CATTENTION_REQUIRE_OPENMP") == "1":
                raise RuntimeError(
                    "cattention: OpenMP was required (CATTENTION_REQUIRE_OPENMP=1) "
                    "but the compiler could not build and run an OpenMP program")
            print("*" * 72, file=sys.stderr)
            print("cattention: WARNING: OpenMP not found; building a SERIAL extension.",
                  file=sys.stderr)
            print("cattention: show_config() will report 'OpenMP: no'.", file=sys.stderr)
            print("*" * 72, file=sys.stderr)
        else:
            print(f"cattention: OpenMP found, building with {' '.join(flags[0])}")
        for ext in self.extensions:
            if flags is not None:
                ext.extra_compile_args += flags[0]
                ext.extra_link_args += flags[1]
        super().build_extensions()


extra_compile_args = ["-O3", "-fno-math-errno", "-Wno-unused-function"]
if sysconfig.get_platform().startswith("win"):
    extra_compile_args = ["/O2"]

# `make asan`: AddressSanitizer + UndefinedBehaviorSanitizer, every report fatal
SANITIZE = os.environ.get("CATTENTION_SANITIZE") == "1"
if SANITIZE:
    extra_compile_args += ["-O1", "-g", "-fno-omit-frame-pointer",
                           "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]

extensions = [
    Extension(
        "cattention._driver.extension",
        sources=[
            "cattention/_driver/extension.pyx",
            "src/dispatch.c",
            "src/kernels_baseline.c",
            # one line per instruction set (each file is empty elsewhere)
            "src/kernels_avx2.c",
            "src/kernels_avx512.c",
            "src/kernels_avx512bf16.c",
            "src/kernels_amx.c",
            "src/kernels_neon.c",
            "src/scalar.c",
            "src/scratch.c",
            "src/fork_safety.c",
            "src/build_info.c",
            "src/team.c",
        ],
        # the kernel headers: a change to one rebuilds the extension (only
        # the sources' own dates count otherwise)
        depends=sorted(glob.glob("src/*.h")) + sorted(glob.glob("cattention/include/*.h")),
        include_dirs=["src", "cattention/include", np.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=extra_compile_args,
        extra_link_args=["-fsanitize=address,undefined"] if SANITIZE else [],
    ),
    # the public cimport contract (cython_attention.pxd), forwarding to the driver
    Extension(
        "cattention.cython_attention",
        sources=["cattention/cython_attention.pyx"],
        include_dirs=["cattention/include", np.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=extra_compile_args,
        extra_link_args=["-fsanitize=address,undefined"] if SANITIZE else [],
    ),
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives={"language_level": 3},
        include_path=["."],
    ),
    cmdclass={"build_ext": BuildExt},
)
