"""Packaging beyond pyproject.toml: a wheel carries the CPU demo's config, prompts and models.

They live outside the package in a checkout (examples/, data/); `build_py` copies them into
opd_cache/demo_data/ in the same layout, so `opd demo` works from an installed package
(opd_cache/launch/demo_assets.py lists them and finds them). An editable install reads the checkout's own files.
"""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
# by path: the package is not importable (nor are its dependencies installed) while it is being built
_spec = importlib.util.spec_from_file_location("_opd_demo_assets", HERE / "opd_cache" / "launch" / "demo_assets.py")
demo_assets = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo_assets)


class build_py_with_demo_files(build_py):
    def run(self):
        super().run()
        if not self.editable_mode:
            demo_assets.copy_demo_files(HERE, Path(self.build_lib) / "opd_cache" / "demo_data")


setup(cmdclass={"build_py": build_py_with_demo_files})
