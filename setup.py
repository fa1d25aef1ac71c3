"""Builds the CPU kernel library at install: every variant of this machine's architecture, from
tokenmill/executor/kernels/build.py (the rest of the package is plain Python, described in pyproject.toml)."""
import importlib.util
import os
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_spec = importlib.util.spec_from_file_location(
    "tokenmill_kernel_build", Path(__file__).resolve().parent / "tokenmill" / "executor" / "kernels" / "build.py")
kbuild = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kbuild)
PACKAGE = "tokenmill.executor.kernels._lib"


class BuildKernels(build_ext):
    """One 'extension' per variant, all compiled by build.py in one parallel go: plain shared libraries that
    ctypes loads (kernels/library.py), named as build.py names them."""

    def get_ext_filename(self, fullname: str) -> str:
        *package, isa = fullname.split(".")
        return os.path.join(*package, kbuild.library_name(isa))

    def build_extensions(self) -> None:
        isas = [ext.name.rsplit(".", 1)[1] for ext in self.extensions]
        kbuild.build(Path(self.get_ext_fullpath(self.extensions[0].name)).parent, isas=isas)
        kbuild.OUT.mkdir(exist_ok=True)      # an editable install copies the libraries here next


setup(ext_modules=[Extension(f"{PACKAGE}.{isa}", sources=[]) for isa in kbuild.VARIANTS.get(kbuild.machine(), {})],
      cmdclass={"build_ext": BuildKernels})
