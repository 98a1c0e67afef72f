"""Installs kvtrail_sglang.pth next to the package, so that setting
KVTRAIL_CAPTURE in an engine's environment is enough to enable capture
(the .pth line imports kvtrail_sglang._autoload, which does nothing unless
that variable is set)."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(
            os.path.join("src", "kvtrail_sglang.pth"),
            os.path.join(self.build_lib, "kvtrail_sglang.pth"),
        )


setup(cmdclass={"build_py": BuildWithPth})
