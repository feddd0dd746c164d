"""One rank of one comparison run: ``python -m benchmarks.ecosystem.rank LIBRARY CASE MODEL_DIR OUT_DIR``.

``LIBRARY`` is ``deepshard`` (``import deepspeed`` answered by deepshard, shadowing the real DeepSpeed
installed in the same environment) or ``deepspeed`` (the real DeepSpeed 0.19.8, ``DS_ACCELERATOR=cpu``).
Both get deepshard's CPU adjustments of Accelerate and transformers (``deepshard/compat/hf_patches.py``:
Accelerate's backend is gloo with DeepSpeed requested, and bf16 is allowed without a GPU), which change
no numbers; without them neither library runs DeepSpeed through Accelerate on a CPU. The rank writes its
result as ``OUT_DIR/rank<RANK>.json``.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> None:
    library, case, model_dir, out_dir = sys.argv[1:5]
    if library == "deepshard":
        import deepshard.compat

        deepshard.compat.install(replace_installed=True)
    elif library == "deepspeed":
        from deepshard.compat.hf_patches import install_hooks

        install_hooks()
    else:
        raise SystemExit(f"library must be deepshard or deepspeed, got {library!r}")
    import torch

    torch.use_deterministic_algorithms(True)
    from benchmarks.ecosystem.cases import RUNNERS

    import deepspeed

    result = RUNNERS[case](Path(model_dir), Path(out_dir))
    result["deepspeed"] = str(deepspeed.__version__)
    rank = int(os.environ.get("RANK", "0"))
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
