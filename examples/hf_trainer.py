"""The Hugging Face Trainer with a DeepSpeed config, on deepshard: the script never imports deepshard.

    deepshard --num_gpus 2 examples/hf_trainer.py --deepspeed examples/hf_trainer_ds_config.json
    python examples/hf_trainer.py                  # one process, no DeepSpeed: the plain Trainer

This is the form Hugging Face documents for DeepSpeed (``deepspeed --num_gpus 2 train.py --deepspeed
ds.json``): ``TrainingArguments`` from the command line, a config whose ``"auto"`` values the Trainer
fills in from them (batch sizes, accumulation, clipping, bf16 with ``--bf16``), ZeRO stage 2. Under the
``deepshard`` launcher the Trainer's ``import deepspeed`` finds deepshard. The model is a small LLaMA built
from a config (nothing is downloaded; needs ``pip install ".[hf]"``), the data synthetic token sequences
with a learnable rule. Any ``TrainingArguments`` flag works (``--max_steps``, ``--learning_rate``,
``--bf16``, ``--save_strategy steps``, ...). With the same global batch (``--per_device_train_batch_size``
x processes) both commands log the same losses (fp32, to round-off). docs/accelerate.md has the rest.
"""
import torch
from transformers import (HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback,
                          TrainingArguments)

VOCAB, SEQ = 128, 32


class PrintLoss(TrainerCallback):
    """One plain line per logged step, on the main process."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            print(f"step {state.global_step:3d}  loss {logs['loss']:.6f}", flush=True)


def dataset(size: int = 256) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    start, stride = torch.randint(0, VOCAB, (size, 1), generator=g), torch.randint(1, 4, (size, 1), generator=g)
    ids = (start + stride * torch.arange(SEQ)) % VOCAB
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def main() -> None:
    parser = HfArgumentParser(TrainingArguments)
    parser.set_defaults(output_dir="runs/hf_trainer", max_steps=30, per_device_train_batch_size=4,
                        learning_rate=3e-3, logging_steps=5, save_strategy="no", disable_tqdm=True, seed=0)
    (args,) = parser.parse_args_into_dataclasses()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=SEQ))
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), callbacks=[PrintLoss()])
    result = trainer.train()
    if trainer.is_world_process_zero():
        print(f"done: {result.global_step} steps on {args.world_size} process(es), DeepSpeed config "
              f"{args.deepspeed or 'none'}, mean training loss {result.training_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
