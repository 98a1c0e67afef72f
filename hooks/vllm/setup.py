"""Installs kvtrail_vllm.pth next to the package, so that setting
KVTRAIL_CAPTURE in an engine's environment is enough to enable capture
(the .pth line imports kvtrail_vllm._autoload, which does nothing unless
that variable is set)."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(
            os.path.join("src", "kvtrail_vllm.pth"),
            os.path.join(self.build_lib, "kvtrail_vllm.pth"),
        )


setup(cmdclass={"build_py": BuildWithPth})
