"""The ``deepshard`` launcher: hostfile parsing and node selection, per-rank commands, local supervision.

Entry point: :func:`deepshard.launcher.cli.main` (the ``deepshard`` console script).
"""
from deepshard.launcher.hostfile import (
    assign_ranks,
    parse_hostfile,
    parse_node_spec,
    read_hostfile,
    resolve_resources,
)

__all__ = ["assign_ranks", "parse_hostfile", "parse_node_spec", "read_hostfile", "resolve_resources"]
