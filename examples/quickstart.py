import argparse

import torch
import deepshard as deepspeed  # the only line that differs from a DeepSpeed script

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
parser = deepspeed.add_config_arguments(parser)  # adds --deepspeed and --deepspeed_config
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
engine, optimizer, _, lr_scheduler = deepspeed.initialize(
    args=args, model=model, model_parameters=model.parameters())

for step in range(100):
    x = torch.randn(engine.train_micro_batch_size_per_gpu(), 32, device=engine.device)
    # inputs reach the model as given (as in DeepSpeed): cast them to its dtype, bf16 in this config
    loss = torch.nn.functional.mse_loss(engine(x.to(torch.bfloat16)).float(), x.sum(dim=1, keepdim=True))
    engine.backward(loss)
    engine.step()
    if engine.global_rank == 0 and step % 20 == 0:
        print(f"micro-step {step}: loss {loss.item():.4f}, lr {engine.get_lr()[0]:.2e}")
engine.save_checkpoint("checkpoints")  # every process calls it
