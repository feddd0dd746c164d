"""Train a tiny model with two MoE layers (4 and 2 experts) under either library, save or resume, print the
losses as JSON (the last line, from rank 0). It spawns ``--dp`` gloo processes itself.

    python moe_ckpt_worker.py --library deepspeed --stage 2 --ep 2 --save DIR --steps 3 --then 3
    python moe_ckpt_worker.py --library deepshard --stage 0 --ep 1 --dp 1 --load DIR --steps 3

Every step consumes the same global batch of 8 samples whatever the data-parallel size; the MoE layers draw
no random numbers (top-2 without sampling), so a run's losses depend on its layout only through the
per-rank capacity (each rank routes its own 8 / dp samples).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys

GLOBAL_BATCH, IN, HID, OUT = 8, 8, 16, 4


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _library(name: str):
    if name == "deepspeed":
        import deepspeed
        import deepspeed.comm.torch  # noqa: F401

        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # no C++ build (see ds_worker.py)
        return deepspeed
    import deepshard.compat as compat

    compat.install(replace_installed=True)
    import deepspeed

    return deepspeed


def _model(deepspeed, ep: int):
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(7)
            self.embed = nn.Linear(IN, HID)
            mlp = nn.Sequential(nn.Linear(HID, 24), nn.ReLU(), nn.Linear(24, HID))
            options = {"k": 2, "top2_2nd_expert_sampling": False, "min_capacity": 2}
            self.moe_a = deepspeed.moe.layer.MoE(HID, mlp, num_experts=4, ep_size=ep, **options)
            self.mid = nn.Linear(HID, HID)
            self.moe_b = deepspeed.moe.layer.MoE(HID, mlp, num_experts=2, ep_size=min(ep, 2), **options)
            self.head = nn.Linear(HID, OUT)
            # experts differ (the layer deep-copies one expert); each by its global id, so every ep size
            # builds the same model
            rank = torch.distributed.get_rank()
            with torch.no_grad():
                for layer, moe in enumerate((self.moe_a, self.moe_b)):
                    local = moe.deepspeed_moe.experts.deepspeed_experts
                    first = (rank % moe.ep_size) * len(local)
                    for i, expert in enumerate(local):
                        g = torch.Generator().manual_seed(11 + 100 * layer + first + i)
                        for p in expert.parameters():
                            p.add_(0.2 * torch.randn(p.shape, generator=g))

        def forward(self, x):
            h = torch.relu(self.embed(x))
            h, aux_a, _ = self.moe_a(h)
            h, aux_b, _ = self.moe_b(torch.tanh(self.mid(h)))
            return self.head(h), aux_a + aux_b

    return Net()


def run(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(args.dp), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    import torch

    torch.set_num_threads(1)
    deepspeed = _library(args.library)
    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for stage in args.stage:  # one world, one engine after the other
        save = None if not args.save else args.save if len(args.stage) == 1 else f"{args.save}/z{stage}"
        results[f"z{stage}"] = train(deepspeed, rank, args.dp, stage, args.ep, args.load, save, args.steps, args.then)
    for spec in args.resume:  # then resume other directories, each at its own stage and ep size
        label, rest = spec.split("=", 1)
        directory, stage, ep = rest.rsplit(":", 2)
        results[label] = train(deepspeed, rank, args.dp, int(stage), int(ep), directory, None, args.steps)
    if rank == 0:
        print(json.dumps(results if len(results) > 1 else results[f"z{args.stage[0]}"]), flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # DeepSpeed's engines leave threads that abort the interpreter's exit (see ds_worker.py)


def train(deepspeed, rank: int, dp: int, stage: int, ep: int, load: str | None, save: str | None, steps: int,
          then: int = 0) -> dict:
    """A fresh engine: load ``load``, train ``steps``, save to ``save``, train ``then`` more (what a resume of
    the saved checkpoint must repeat). Its losses (the mean over ranks), counters and client state."""
    import torch
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    model = _model(deepspeed, ep)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                    "name": "parameters"})
    optimizer = torch.optim.Adam(groups, lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dp,
              "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    client: dict = {}
    if load:
        _, client = engine.load_checkpoint(load)
    losses = [_step(engine, rank, dp) for _ in range(steps)]
    if save:
        engine.save_checkpoint(save, client_state={"epoch": 3})
    after = [_step(engine, rank, dp) for _ in range(then)]
    out = {"losses": losses, "then": after, "global_steps": engine.global_steps,
           "client_state": {k: v for k, v in (client or {}).items() if k == "epoch"}}
    if hasattr(engine, "destroy"):
        engine.destroy()
    return out


def _step(engine, rank: int, dp: int) -> float:
    import torch

    g = torch.Generator().manual_seed(1000 + engine.global_steps)
    x, y = torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)
    share = GLOBAL_BATCH // dp
    out, aux = engine(x[rank * share:(rank + 1) * share])
    loss = torch.nn.functional.mse_loss(out.float(), y[rank * share:(rank + 1) * share]) + 0.01 * aux
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    torch.distributed.all_reduce(mean)
    return float(mean) / dp


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--library", choices=["deepspeed", "deepshard"], default="deepspeed")
    p.add_argument("--stage", type=int, nargs="+", default=[0], help="several: one engine each, saved to SAVE/z<stage>")
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--save")
    p.add_argument("--load")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--then", type=int, default=0, help="steps after saving (a resume's reference)")
    p.add_argument("--resume", nargs="*", default=[], metavar="LABEL=DIR:STAGE:EP",
                   help="after the --stage runs: fresh engines load these directories and train --steps")
    args = p.parse_args()
    if args.library == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch.multiprocessing as mp

    mp.spawn(run, args=(args, _port()), nprocs=args.dp, join=True)


if __name__ == "__main__":
    main()
