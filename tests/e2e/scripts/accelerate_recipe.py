"""DeepSpeed through Accelerate, written as Accelerate's documentation writes it (nothing deepshard-specific
but the output file): a TestNet trained by ``accelerator.prepare`` / ``backward`` / ``step`` with the
DeepSpeed settings that ``deepshard launch --config_file`` passes in the environment. It also checks
``gather_for_metrics`` on an uneven eval set and ``save_state`` / ``load_state`` resuming exactly.

Writes ``$RECIPE_OUT/rank<R>.json``: the world Accelerate saw, this rank's batches and losses, and the
weights ``get_state_dict`` returns after the first steps.
"""
import json
import os
import sys

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from torch.utils.data import DataLoader, TensorDataset


class TestNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g))


def train(accelerator, model, optimizer, loader, steps: int) -> list[float]:
    losses = []
    for _, (x, y) in zip(range(steps), loader):
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    out_dir, ckpt = os.environ["RECIPE_OUT"], os.path.join(os.environ["RECIPE_OUT"], "state")
    deepspeed_plugin = DeepSpeedPlugin()  # every setting from the launcher's environment
    accelerator = Accelerator(deepspeed_plugin=deepspeed_plugin)
    torch.manual_seed(0)
    model = TestNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(data(64, seed=1), batch_size=4, shuffle=False)
    with accelerator.main_process_first():
        eval_loader = DataLoader(data(10, seed=2), batch_size=4, shuffle=False)
    model, optimizer, loader, eval_loader = accelerator.prepare(model, optimizer, loader, eval_loader)
    first_x = next(iter(loader))[0]
    losses = train(accelerator, model, optimizer, loader, steps=6)
    state = accelerator.get_state_dict(model)  # every rank calls it; the full weights
    weights = {k: v.tolist() for k, v in state.items()}
    accelerator.save_state(ckpt)
    after = train(accelerator, model, optimizer, loader, steps=4)
    accelerator.load_state(ckpt)
    resumed = train(accelerator, model, optimizer, loader, steps=4)
    model.eval()
    gathered = []
    for x, y in eval_loader:
        with torch.no_grad():
            gathered.append(accelerator.gather_for_metrics(model(x)))
    record = {"num_processes": accelerator.num_processes, "process_index": accelerator.process_index,
              "is_main": accelerator.is_main_process, "distributed_type": str(accelerator.distributed_type),
              "first_x": first_x.tolist(), "losses": losses, "after": after, "resumed": resumed,
              "eval_rows": int(sum(g.shape[0] for g in gathered)),
              "deepspeed_module": sys.modules["deepspeed"].__name__,
              "zero_stage": model.zero_optimization_stage(), "weights": weights,
              "optimizer_class": type(optimizer.optimizer).__name__,  # engine.optimizer: the ZeRO optimizer
              "torch_optimizer_class": type(optimizer.optimizer.optimizer).__name__}
    with open(os.path.join(out_dir, f"rank{accelerator.process_index}.json"), "w") as fh:
        json.dump(record, fh)
    accelerator.end_training()


if __name__ == "__main__":
    main()
