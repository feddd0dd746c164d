"""What a ``DeepSpeedCheckpoint`` says of one Megatron-DeepSpeed tag folder at several target layouts, as
JSON-ready data: the same calls made under the real DeepSpeed (``python -m tests.unit.megatron_readout
<folder>``, in its venv) and under deepshard, so ``test_megatron_checkpoint`` can compare the two. Imports no
deepshard: the class under test is passed in."""
from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any

TARGETS = ((1, 1, 1), (2, 1, 2), (1, 2, 1), (2, 2, 2), (1, 1, 2))
"""Target ``(pp, tp, dp)`` layouts read from a folder saved at pp=2, tp=2, dp=2."""


def _tensors(state: dict[str, Any]) -> dict[str, Any]:
    return {key: value.tolist() for key, value in state.items()}


def _position(ckpt: Any, pp: int, tp: int) -> dict[str, Any]:
    return {"model_files": [Path(f).name for f in ckpt.get_2d_parallel_files(tp_index=tp, pp_index=pp)],
            "layers": ckpt.get_pp_transformer_map(pp),
            "transformer": [_tensors(s) for s in ckpt.get_transformer_state(tp_index=tp, pp_index=pp)]}


def _zero(ckpt: Any, pp: int, tp: int, dp: int) -> dict[str, Any]:
    osd = ckpt.get_zero_checkpoint_state(pp_index=pp, tp_index=tp, dp_index=dp)["optimizer_state_dict"]
    return {"files": [Path(f).name for f in ckpt.get_zero_files(pp, tp, dp)],
            "state": {str(k): _tensors(v) for k, v in osd["base_optimizer_state"]["state"].items()},
            "partition_count": osd["partition_count"], "group_paddings": osd["group_paddings"]}


def readout(checkpoint_class: type, folder: str) -> dict[str, Any]:
    """Every answer of ``checkpoint_class(folder, ...)`` at each of :data:`TARGETS`, keyed ``"pp,tp,dp"``."""
    out: dict[str, Any] = {}
    for pp, tp, dp in TARGETS:
        ckpt = checkpoint_class(folder, tp_degree=tp, pp_degree=pp, dp_degree=dp)
        got: dict[str, Any] = {"sizes": [ckpt.original_world_size, ckpt.world_size, ckpt.layer_count],
                               "iteration": ckpt.get_iteration(), "info": ckpt.get_checkpoint_info()}
        for p, t in itertools.product(range(pp), range(tp)):
            got[f"position {p},{t}"] = _position(ckpt, p, t)
            got.update({f"zero {p},{t},{d}": _zero(ckpt, p, t, d) for d in range(dp)})
        for t in range(tp):
            got[f"embedding {t}"] = _tensors(ckpt.get_embedding_state(t))
            got[f"final norm {t}"] = _tensors(ckpt.get_final_norm_state(t))
        out[f"{pp},{tp},{dp}"] = got
    return out


if __name__ == "__main__":
    from deepspeed.checkpoint import DeepSpeedCheckpoint

    print("=====")
    print(json.dumps(readout(DeepSpeedCheckpoint, sys.argv[1]), sort_keys=True))
