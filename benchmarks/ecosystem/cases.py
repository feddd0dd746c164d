"""The TRL / PEFT runs compared between deepshard and DeepSpeed: what one rank does for each case.

Every case trains the tiny model of ``tiny.py`` for a few steps through a real TRL trainer with a
DeepSpeed config (``TrainingArguments(deepspeed=...)``, as TRL's documented runs do through Accelerate)
and returns what it logged per step. The same code runs under both libraries; only ``import deepspeed``
differs (``rank.py``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

STEPS = 4
CASES = ("sft_zero2", "sft_zero3", "dpo_zero3", "grpo_zero3", "lora_zero3")


def ds_config(stage: int, bf16: bool = False) -> dict[str, Any]:
    """The DeepSpeed config: "auto" where the Trainer fills it in; at stage 3 nothing kept whole
    (persistence threshold 0) so that every parameter is really partitioned and gathered."""
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero.update({"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 2000,
                     "stage3_gather_16bit_weights_on_model_save": True})
    return {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"}, "zero_optimization": zero}


def common_args(out: Path, stage: int, bf16: bool) -> dict[str, Any]:
    return {"output_dir": str(out), "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1,
            "max_steps": STEPS, "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "no",
            "report_to": [], "seed": 0, "data_seed": 0, "bf16": bf16, "deepspeed": ds_config(stage, bf16),
            "disable_tqdm": True, "dataloader_num_workers": 0, "use_liger_kernel": False}


def _collector() -> Any:
    """A TrainerCallback collecting every logged dict that has a loss (one per step here)."""
    from transformers import TrainerCallback

    class Collector(TrainerCallback):
        def __init__(self) -> None:
            self.rows: list[dict[str, float]] = []

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "loss" in logs:
                self.rows.append({k: float(v) for k, v in logs.items() if isinstance(v, (int, float))})

    return Collector()


def _dataset(rows: dict[str, list[str]]) -> Any:
    from datasets import Dataset

    return Dataset.from_dict(rows)


def sft(model_dir: Path, out: Path, stage: int, bf16: bool = False, lora: bool = False) -> dict[str, Any]:
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from benchmarks.ecosystem.tiny import text_rows

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = SFTConfig(**common_args(out, stage, bf16), max_length=32)
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                 task_type="CAUSAL_LM")
    logs = _collector()
    trainer = SFTTrainer(model=str(model_dir), args=args, train_dataset=_dataset(text_rows(64)),
                         processing_class=tokenizer, callbacks=[logs], peft_config=peft_config)
    trainer.train()
    result: dict[str, Any] = {"logs": logs.rows}
    if lora:
        result.update(_save_adapter(trainer, out))
    return result


def _save_adapter(trainer: Any, out: Path) -> dict[str, Any]:
    """Save the adapter (a collective under ZeRO-3); ``reload.py`` loads it in a fresh process."""
    adapter_dir = out / "adapter"
    trainer.save_model(str(adapter_dir))
    trainer.accelerator.wait_for_everyone()
    return {"adapter_dir": str(adapter_dir)}


def dpo(model_dir: Path, out: Path, stage: int, bf16: bool = False) -> dict[str, Any]:
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from benchmarks.ecosystem.tiny import preference_rows

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = DPOConfig(**common_args(out, stage, bf16), beta=0.1, max_length=32)
    logs = _collector()
    trainer = DPOTrainer(model=str(model_dir), args=args, train_dataset=_dataset(preference_rows(64)),
                         processing_class=tokenizer, callbacks=[logs])
    trainer.train()
    return {"logs": logs.rows}


def grpo(model_dir: Path, out: Path, stage: int, bf16: bool = False) -> dict[str, Any]:
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.ecosystem.tiny import count_a_reward, prompt_rows

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    args = GRPOConfig(**common_args(out, stage, bf16), num_generations=2, max_completion_length=8,
                      temperature=1.0, use_vllm=False, beta=0.04)
    logs = _collector()
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=[count_a_reward], args=args,
                          train_dataset=_dataset(prompt_rows(64)), processing_class=tokenizer, callbacks=[logs])
    trainer.train()
    return {"logs": logs.rows}


RUNNERS: dict[str, Callable[[Path, Path], dict[str, Any]]] = {
    "sft_zero2": lambda m, o: sft(m, o, 2),
    "sft_zero3": lambda m, o: sft(m, o, 3),
    "dpo_zero3": lambda m, o: dpo(m, o, 3),
    "grpo_zero3": lambda m, o: grpo(m, o, 3),
    "lora_zero3": lambda m, o: sft(m, o, 3, lora=True),
}
