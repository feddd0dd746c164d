"""A Trainer script in the form Hugging Face documents, ``deepspeed --num_gpus 2 train.py --deepspeed ds.json
...``: TrainingArguments from the command line (HfArgumentParser), no deepshard import anywhere."""
import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

(args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16))
ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(3))
data = [{"input_ids": r, "labels": r.clone()} for r in ids]
trainer = Trainer(model=model, args=args, train_dataset=data)
out = trainer.train()
import deepspeed
print(f"RESULT rank {args.process_index} loss {out.training_loss:.4f} deepspeed={deepspeed.__file__}", flush=True)
