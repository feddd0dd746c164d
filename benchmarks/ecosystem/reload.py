"""Load a saved LoRA adapter onto a fresh base model in a plain process (no DeepSpeed, no deepshard):
``python -m benchmarks.ecosystem.reload MODEL_DIR ADAPTER_DIR OUT_JSON``. Writes the adapter's files, its
weights and the logits of a fixed input, which ``run_compare`` compares between the two libraries' runs."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir, adapter_dir, out = (Path(a) for a in sys.argv[1:4])
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter_dir)
    lora = {n: p.detach().float().tolist() for n, p in model.named_parameters() if "lora_" in n}
    with torch.no_grad():
        logits = model(torch.arange(4, 20).reshape(2, 8)).logits.float()
    out.write_text(json.dumps({"adapter_files": sorted(p.name for p in adapter_dir.iterdir()), "adapter": lora,
                               "reloaded_logits": logits.tolist()}))


if __name__ == "__main__":
    main()
