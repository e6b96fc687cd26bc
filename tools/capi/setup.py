"""Builds tools/capi/downstream.pyx against the installed cattention."""

import os

import cattention
from Cython.Build import cythonize
from setuptools import Extension, setup

# the directory holding the installed package, where Cython finds
# cattention/cython_attention.pxd (an editable install is not on sys.path as such)
site = os.path.dirname(os.path.dirname(os.path.abspath(cattention.__file__)))

setup(
    name="downstream",
    ext_modules=cythonize(
        [Extension("downstream", ["downstream.pyx"],
                   include_dirs=[cattention.get_include()],
                   extra_compile_args=["-fopenmp"], extra_link_args=["-fopenmp"])],
        include_path=[site],
        compiler_directives={"language_level": 3},
    ),
)
