"""DeepSpeed's checkpoint directories, read and written by deepshard without running a pickle.

``detect``: is a directory DeepSpeed's; ``safe_load``: one ``.pt`` through an allowlist (``allowlist``);
``flat``: DeepSpeed's flat partitions <-> tensors; ``read``: a tag directory as a :class:`FullState` and
an engine record (``checkpoint.reader.DeepSpeedTag`` loads it into an engine); ``write``: a deepshard
checkpoint as a DeepSpeed directory.
"""
from deepshard.checkpoint.deepspeed_format.detect import deepspeed_tag_dir, is_deepspeed_tag
from deepshard.checkpoint.deepspeed_format.read import read_engine_record, read_full_state
from deepshard.checkpoint.deepspeed_format.safe_load import UnsafeCheckpointError, load_pt

__all__ = ["UnsafeCheckpointError", "deepspeed_tag_dir", "is_deepspeed_tag", "load_pt", "read_engine_record",
           "read_full_state"]
