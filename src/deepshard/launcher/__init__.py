"""The ``deepshard`` launcher: hostfile parsing and node selection, per-rank commands, local
supervision, and multi-node launch (per-node agents coordinated through a TCPStore; ssh, pdsh,
``--no_ssh``, MPI and Slurm runners; restarts)."""
from deepshard.launcher.hostfile import (
    assign_ranks,
    decode_world_info,
    encode_world_info,
    parse_hostfile,
    parse_node_spec,
    read_hostfile,
    resolve_resources,
)

__all__ = ["assign_ranks", "decode_world_info", "encode_world_info", "parse_hostfile", "parse_node_spec",
           "read_hostfile", "resolve_resources"]
