"""DeepSpeed's launcher module path, ``deepshard.launcher.runner`` (``deepspeed.launcher.runner``): ``main(argv)``
runs the ``deepshard`` launcher and returns its exit status (an impossible launch raises ``ValueError``, as
DeepSpeed's does; ``python -m deepshard.launcher.runner`` prints it instead, as the ``deepshard`` command); the
module's DeepSpeed names are :mod:`deepshard.compat.launcher_runner`'s."""
import sys

from deepshard.compat.launcher_runner import *  # noqa: F403 - the names DeepSpeed's module has
from deepshard.compat.launcher_runner import _parse_hostfile, main  # noqa: F401 - DeepSpeed's unit tests use both

if __name__ == "__main__":
    from deepshard.launcher.cli import main as _command

    sys.exit(_command())  # as the command: an impossible launch is reported in one line, not a traceback
