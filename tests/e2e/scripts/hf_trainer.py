"""A ``transformers`` Trainer run as its users write it: a tiny LLaMA-style model built from a config,
synthetic token data, ``deepspeed=`` a config of ``"auto"`` values (or no DeepSpeed: the plain
reference). For each (ZeRO stage, precision) case given: train, ``save_model``, then a second Trainer
``resume_from_checkpoint`` from the middle checkpoint.

    python trainer_script.py OUT_DIR MODE CASE [CASE ...]     MODE: ds | plain;  CASE: z2-fp32, z3-bf16, z2-fp32-ga2 (accumulation 2), ...

Writes ``OUT_DIR/<case>/losses-rank<R>.json`` (per-step training losses of the run and of the resumed run)
and ``OUT_DIR/<case>/final`` (the saved model).
"""
import json
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

GLOBAL_BATCH, STEPS, SAVE_AT = 4, 6, 3


class Losses(TrainerCallback):
    def __init__(self) -> None:
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def dataset() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (32, 8), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    return LlamaForCausalLM(config)


def ds_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True}}


def arguments(out: str, mode: str, stage: int, bf16: bool, accumulation: int = 1) -> TrainingArguments:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return TrainingArguments(
        output_dir=out, per_device_train_batch_size=GLOBAL_BATCH // world // accumulation,
        gradient_accumulation_steps=accumulation, max_steps=STEPS, learning_rate=1e-2,
        warmup_steps=2, logging_steps=1, save_strategy="steps", save_steps=SAVE_AT, report_to=[], seed=0,
        bf16=bf16, use_cpu=(mode == "plain"), deepspeed=ds_config(stage) if mode == "ds" else None,
        dataloader_num_workers=0, disable_tqdm=True, save_only_model=False)


def run_case(out_root: str, mode: str, case: str) -> None:
    stage, precision = int(case[1]), case.split("-")[1]
    accumulation = int(case.split("-ga")[1]) if "-ga" in case else 1
    out = os.path.join(out_root, case)
    args = arguments(out, mode, stage, precision == "bf16", accumulation)
    first = Losses()
    trainer = Trainer(model=model(), args=args, train_dataset=dataset(), callbacks=[first])
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    resumed = Losses()
    trainer = Trainer(model=model(), args=arguments(out, mode, stage, precision == "bf16", accumulation),
                      train_dataset=dataset(), callbacks=[resumed])
    trainer.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{SAVE_AT}"))
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out, f"losses-rank{rank}.json"), "w") as fh:
        json.dump({"losses": first.losses, "resumed": resumed.losses,
                   "world": trainer.accelerator.num_processes}, fh)


if __name__ == "__main__":
    for case in sys.argv[3:]:
        run_case(sys.argv[1], sys.argv[2], case)
