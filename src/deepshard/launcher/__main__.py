"""``python -m deepshard.launcher ...``: the same as the ``deepshard`` command."""
import sys

from deepshard.launcher.cli import main

sys.exit(main())
