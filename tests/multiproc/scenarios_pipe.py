"""Pipeline-parallel oracle scenarios: a tiny GPT-style model (token embedding tied to the output head,
causal attention + MLP blocks) trained by ``PipelineEngine`` against the same model in one process (same
seed, same global batch): the same losses and the same parameters, to fp32 round-off.

Each world runs many configurations (schedule x ZeRO stage x micro-batch count) one after another."""
from __future__ import annotations

import os

from typing import Any

import torch
from torch import nn
import torch.nn.functional as F

VOCAB, HIDDEN, BLOCKS, MICRO = 13, 8, 4, 2


class Embed(nn.Embedding):
    """Token embedding; as the tied head, ``head`` serves logits from the same weight."""

    def __init__(self) -> None:
        super().__init__(VOCAB, HIDDEN)


def head(module: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    return x @ module.weight.t()


class Block(nn.Module):
    """Pre-norm single-head causal attention and an MLP, both residual. No qkv bias: the key bias has a
    zero gradient in exact arithmetic, and Adam would turn its round-off into full-size updates."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False), nn.Linear(HIDDEN, HIDDEN)
        self.fc1, self.fc2 = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def layers() -> list:
    from deepshard.pipe import LayerSpec, TiedLayerSpec

    return ([TiedLayerSpec("embed", Embed)] + [LayerSpec(Block) for _ in range(BLOCKS)]
            + [TiedLayerSpec("embed", Embed, forward_fn=head)])


def batches(steps: int, rows: int, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token batches whose sequence length changes from step to step (shapes are never cached)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        tokens = torch.randint(0, VOCAB, (rows, 5 + s % 3 + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def reference(steps: int, m: int, dp: int, clip: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same model trained in this process on the whole global batch."""
    from deepshard.pipe import PipelineModule

    model = PipelineModule(layers(), num_stages=1, stage_id=0, loss_fn=lm_loss, seed_layers=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for x, y in batches(steps, MICRO * m * dp):
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.split(MICRO), y.split(MICRO)):
            loss = lm_loss(model(xs), ys)
            (loss / (m * dp)).backward()
            total += loss.item() / (m * dp)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _data(steps: int, m: int, dp: int, dp_rank: int):
    """This data-parallel rank's (inputs, labels) micro-batches, in order."""
    for x, y in batches(steps, MICRO * m * dp):
        xs, ys = x.split(MICRO), y.split(MICRO)
        for i in range(m):
            yield xs[dp_rank * m + i], ys[dp_rank * m + i]


def train_pipeline(pp: int, schedule: str, zero: int, m: int, steps: int, clip: float = 0.5,
                   extra: dict[str, Any] | None = None) -> dict[str, Any]:
    import deepshard
    from deepshard.pipe import PipelineModule
    from tests.multiproc.device import to_host

    chunks = 2 if schedule == "interleaved" else 1  # 6 layers in 4 virtual stages at pp=2
    model = PipelineModule(layers(), num_stages=pp, loss_fn=lm_loss, seed_layers=True, num_chunks=chunks)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": m,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "zero_optimization": {"stage": zero}, "gradient_clipping": clip, "pipeline": {"schedule": schedule}}
    for key, value in (extra or {}).items():
        cfg[key] = {**cfg.get(key, {}), **value}
    engine, _, _, _ = deepshard.initialize(model=model, config=cfg)
    dp = engine.dp_world_size
    it = _data(steps, m, dp, engine.topology.coord.dp)
    losses = [float(engine.train_batch(it)) for _ in range(steps)]
    # on the CPU, where the reference is (the engine's device is the CPU unless the suite runs with --device cuda)
    params = {k: engine.strategy.full_fp32_param(p).cpu().clone() for k, p in model.named_parameters()}
    # eval: every micro-batch's logits on the last stage, loss on every stage
    x, y = batches(1, MICRO * m * dp, seed=11)[0]
    mine = [(a, b) for a, b in zip(x.split(MICRO), y.split(MICRO))][engine.topology.coord.dp * m:][:m]
    eval_loss, logits = engine.eval_batch(iter(mine), return_logits=True)
    out = {"losses": losses, "params": params, "eval_loss": float(eval_loss), "logits": to_host(logits),
           "stage": engine.stage_id, "dp": dp, "first": engine.is_first_stage(), "last": engine.is_last_stage(),
           "eval_inputs": mine, "states": type(getattr(engine.strategy, "states", None)).__name__}
    engine.destroy()
    return out


def check(result: dict[str, Any], m: int, steps: int, clip: float = 0.5) -> None:
    """Losses and this stage's parameters as the reference's; eval_batch's logits of every micro-batch
    and its mean loss as the reference's forward."""
    from deepshard.pipe import PipelineModule

    ref_losses, ref_params = reference(steps, m, result["dp"], clip)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert result["params"], "this stage holds no parameters"
    for name, value in result["params"].items():
        torch.testing.assert_close(value, ref_params[name], rtol=1e-4, atol=1e-5, msg=lambda s: f"{name}: {s}")
    ref = PipelineModule(layers(), num_stages=1, stage_id=0, loss_fn=lm_loss)
    ref.load_state_dict(ref_params, strict=False)
    with torch.no_grad():
        outs = [ref(x) for x, _ in result["eval_inputs"]]
        losses = [lm_loss(o, y) for o, (_, y) in zip(outs, result["eval_inputs"])]
    if result["last"]:
        assert len(result["logits"]) == m
        for got, want in zip(result["logits"], outs):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    else:
        assert result["logits"] is None
    if result["dp"] == 1:  # with dp > 1 the loss is also averaged over the other ranks' micro-batches
        assert abs(result["eval_loss"] - float(torch.stack(losses).mean())) < 1e-5


RECOMPUTE = {"pipeline": {"activation_checkpoint_interval": 2}, "activation_checkpointing": {"cpu_checkpointing": True}}
OFFLOAD = "offload"  # optimizer states in files (offload_optimizer nvme under the world's directory): on
# a CPU-only run "cpu" offload is a no-op, the states already are in host memory
CONFIGS_2 = [("1f1b", 0, 4, None), ("1f1b", 1, 3, None), ("gpipe", 2, 2, None), ("zb-h1", 2, 3, None),
             ("zb-h1", 0, 1, None), ("zb-h1", 1, 3, RECOMPUTE), ("interleaved", 1, 4, None),
             ("interleaved", 2, 2, RECOMPUTE), ("1f1b", 2, 3, OFFLOAD), ("zb-h1", 1, 2, OFFLOAD)]
CONFIGS_4 = [(2, "1f1b", 2, 2), (2, "zb-h1", 1, 3), (2, "gpipe", 0, 2), (2, "interleaved", 0, 2),
             (4, "1f1b", 0, 4), (4, "gpipe", 1, 2), (4, "zb-h1", 2, 3)]
# interleaved at pp=4 would need 8 virtual stages: the 6-layer model has too few layers


def pp2_world(rank: int, world: int, directory: str) -> list[str]:
    """pp=2 (dp=1) under every schedule and ZeRO 0/1/2 for several micro-batch counts; then 16-bit
    precision, the refusals and a checkpoint resumed on other grids (in ``directory``)."""
    done = []
    for schedule, zero, m, extra in CONFIGS_2:
        if extra is OFFLOAD:
            nvme = {"device": "nvme", "nvme_path": os.path.join(directory, f"swap-{schedule}")}
            out = train_pipeline(2, schedule, zero, m, steps=2, extra={"zero_optimization": {"offload_optimizer": nvme}})
        else:
            out = train_pipeline(2, schedule, zero, m, steps=2, extra=extra)
        check(out, m, 2)
        assert (out["states"] == "SubGroupStates") == (extra is OFFLOAD), out["states"]  # the states moved
        done.append(f"{schedule}-z{zero}-m{m}{'' if extra is None else '-offload' if extra is OFFLOAD else '-recompute'}")
    return done + mixed_precision() + inplace_first_layer() + errors(rank) + resume(world, directory)


def mixed_precision() -> list[str]:
    """bf16 (ZeRO-2 and ZeRO-1 under ZB-H1, fp32 masters) and fp16 (ZeRO-0, loss scaling) pipelines track
    the fp32 reference's losses to 16-bit precision, with no skipped step; their gradients are summed over
    the micro-batches in fp32 unless ``data_types.grad_accum_dtype`` names the training dtype."""
    import deepshard
    from deepshard.pipe import PipelineModule

    done = []
    ref, _ = reference(3, 3, 1, 0.5)
    bf16, fp16 = {"bf16": {"enabled": True}}, {"fp16": {"enabled": True, "initial_scale_power": 8}}
    for name, section, zero, fp32_sums in [
            ("bf16", bf16, 2, True), ("bf16-zb-h1", {**bf16, "pipeline": {"schedule": "zb-h1"}}, 1, True),
            ("bf16-accum-bf16", {**bf16, "data_types": {"grad_accum_dtype": "bf16"}}, 1, False),
            ("fp16", fp16, 0, True)]:
        model = PipelineModule(layers(), num_stages=2, loss_fn=lm_loss, seed_layers=True)
        cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 3, "gradient_clipping": 0.5,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
               "zero_optimization": {"stage": zero}, **section}
        engine = deepshard.initialize(model=model, config=cfg)[0]
        assert (engine.grad_sums is not None) == fp32_sums, name
        it = _data(3, 3, 1, 0)
        losses = [float(engine.train_batch(it)) for _ in range(3)]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-2, atol=0)
        assert engine.skipped_steps == 0
        if fp32_sums:
            assert engine.grad_sums.sums == {}  # flushed into the gradients at every batch's end
        engine.destroy()
        done.append(name)
    return done


def inplace_first_layer() -> list[str]:
    """A stage whose first layer works in place (``ReLU(inplace=True)`` opens stage 1 of
    ``[Linear, Linear, ReLU(inplace=True), Linear]`` split uniformly, as AlexNet's features are) trains
    as one process does: the layer is handed a copy of the received activation, not the leaf."""
    import deepshard
    from deepshard.pipe import LayerSpec, PipelineModule

    specs = [LayerSpec(nn.Linear, 4, 8), LayerSpec(nn.Linear, 8, 8), LayerSpec(nn.ReLU, inplace=True),
             LayerSpec(nn.Linear, 8, 3)]
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(MICRO, 4, generator=g), torch.randint(0, 3, (MICRO,), generator=g)) for _ in range(4)]
    ref = PipelineModule(specs, num_stages=1, stage_id=0, loss_fn=F.cross_entropy, seed_layers=True)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for step in range(2):
        opt.zero_grad()
        mbs = data[2 * step:2 * step + 2]
        losses = [F.cross_entropy(ref(x), y) / 2 for x, y in mbs]
        sum(losses).backward()
        opt.step()
        want.append(float(sum(losses)))
    model = PipelineModule(specs, num_stages=2, loss_fn=F.cross_entropy, seed_layers=True, partition_method="uniform")
    assert model.stage_id != 1 or isinstance(model.forward_funcs[0], nn.ReLU), "stage 1 must open with the ReLU"
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine = deepshard.initialize(model=model, config=cfg)[0]
    it = iter(data)
    got = [float(engine.train_batch(it)) for _ in range(2)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach().cpu(), dict(ref.named_parameters())[name].detach(), rtol=1e-5, atol=1e-6)
    engine.destroy()
    return ["inplace-first-layer"]


def pp_dp_world(rank: int, world: int, directory: str) -> list[str]:
    """4 processes: pp=2 x dp=2 and pp=4 under the schedules of ``CONFIGS_4``, then a (2, 2) checkpoint
    resumed on (4, 1) and (1, 4), and back."""
    done = [grid_at_construction(rank)]
    for pp, schedule, zero, m in CONFIGS_4:
        check(train_pipeline(pp, schedule, zero, m, steps=2), m, 2)
        done.append(f"pp{pp}-{schedule}-z{zero}-m{m}")
    return done + resume_across_grids(world, directory)


def grid_at_construction(rank: int) -> str:
    """On 4 ranks: ``PipelineModule(num_stages=2)`` answers DeepSpeed's ``mpu()`` / ``topology()`` before
    ``initialize`` (a DistributedSampler built from it, real groups), and the engine trains on that grid."""
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler

    import deepshard
    from deepshard.pipe import PipelineModule

    model = PipelineModule(layers(), num_stages=2, loss_fn=lm_loss)
    grid, topo = model.mpu(), model.topology()
    assert grid is not None and topo.get_axis_names() == ["pipe", "data"]
    assert (grid.get_stage_id(), grid.get_data_parallel_rank(), grid.get_data_parallel_world_size()) == (rank // 2, rank % 2, 2)
    assert (grid.get_pipe_parallel_world_size(), grid.get_model_parallel_world_size(), grid.get_slice_parallel_world_size()) == (2, 2, 1)
    assert topo.get_coord(rank) == (rank // 2, rank % 2) and topo.get_dim("pipe") == 2 and topo.get_dim("model") == 0
    assert grid.stage_to_global(1 - rank // 2) == (rank + 2) % 4
    assert grid.get_data_parallel_group_ranks() == [rank - rank % 2, rank - rank % 2 + 1]
    for group, want in ((grid.get_data_parallel_group(), 2 * (rank - rank % 2) + 1),
                        (grid.get_pipe_parallel_group(), 2 * (rank % 2) + 2), (grid.get_slice_parallel_group(), rank)):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)  # a real torch process group of the axis (a size-1 axis: this rank alone)
        assert t.item() == want, (t.item(), want)
    sampler = DistributedSampler(list(range(8)), num_replicas=grid.get_data_parallel_world_size(),
                                 rank=grid.get_data_parallel_rank(), shuffle=False)
    assert list(sampler) == list(range(rank % 2, 8, 2))
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine = deepshard.initialize(model=model, config=cfg)[0]
    assert engine.topology is model.grid_topology and model.mpu() is grid  # no second grid
    engine.destroy()
    return "grid-at-construction"


def errors(rank: int) -> list[str]:
    """What a pipeline engine refuses, with DeepSpeed's error, and a shape mismatch named, not hung."""
    import pytest

    import deepshard
    from deepshard.config import ConfigError
    from deepshard.pipe import PipelineModule
    from deepshard.pipe.engine import PipelineError

    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    with pytest.raises(ConfigError, match="stage=3 cannot be combined with pipeline"):
        deepshard.initialize(model=PipelineModule(layers(), num_stages=2, loss_fn=lm_loss),
                             config={**cfg, "zero_optimization": {"stage": 3}})
    with pytest.raises(ConfigError, match="num_chunks=2"):
        deepshard.initialize(model=PipelineModule(layers(), num_stages=2, loss_fn=lm_loss),
                             config={**cfg, "pipeline": {"schedule": "interleaved"}})
    with pytest.raises(ConfigError, match="set pipeline.schedule to 'interleaved'"):
        deepshard.initialize(model=PipelineModule(layers(), num_stages=2, loss_fn=lm_loss, num_chunks=2), config=cfg)
    engine, _, _, _ = deepshard.initialize(model=PipelineModule(layers(), num_stages=2, loss_fn=lm_loss), config=cfg)
    for call in (engine.forward, engine.backward, engine.step):
        with pytest.raises(PipelineError, match="Only train_batch"):
            call(torch.zeros(1))
    with pytest.raises(PipelineError, match="gradients disabled"), torch.no_grad():
        engine.train_batch(iter([]))
    _transfers(rank)
    _posted_ahead(rank)
    engine.destroy()
    return ["ok"]


def _engine(pp: int, m: int, zero: int, seed_layers: bool = True):
    import deepshard
    from deepshard.pipe import PipelineModule

    model = PipelineModule(layers(), num_stages=pp, loss_fn=lm_loss, seed_layers=seed_layers)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": m, "gradient_clipping": 0.5,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "zero_optimization": {"stage": zero}}
    return model, deepshard.initialize(model=model, config=cfg)[0]


def _step_data(step: int, m: int, dp: int, dp_rank: int):
    """Global batch ``step`` of ``batches`` as this rank's micro-batches for an (m, dp) split."""
    data = _data(step + 1, m, dp, dp_rank)
    for _ in range(step * m):
        next(data)
    return data


def _saved_then_next(pp: int, m: int, world: int, directory: str, tag: str) -> tuple[float, dict[str, Any]]:
    """Train (pp, world // pp) at ZeRO-2 for one batch, save ``tag``, train the next: that batch's loss
    and the whole model's parameters after it (every stage's, gathered): what a resume must reproduce."""
    model, engine = _engine(pp, m, zero=2)
    dp, dp_rank = world // pp, engine.topology.coord.dp
    engine.train_batch(_step_data(0, m, dp, dp_rank))
    engine.save_checkpoint(directory, tag=tag)
    loss = float(engine.train_batch(_step_data(1, m, dp, dp_rank)))
    # on the host: sent to the other ranks (each on its own device under --device cuda)
    mine = {k: engine.strategy.full_fp32_param(p).cpu().clone() for k, p in model.named_parameters()}
    engine.destroy()
    stages: list[Any] = [None] * world
    torch.distributed.all_gather_object(stages, mine)
    return loss, {k: v for stage in stages for k, v in stage.items()}


def _resumed(pp: int, zero: int, directory: str, tag: str, world: int) -> tuple[Any, Any, int]:
    """An engine on (pp, world // pp) loaded from ``tag``, and its micro-batch count (the global batch
    kept at 2 x world rows)."""
    m = 2 * world // (MICRO * (world // pp))
    model, engine = _engine(pp, m, zero, seed_layers=False)  # values come from the checkpoint
    engine.load_checkpoint(directory, tag=tag)
    return model, engine, m


def _next_batch_matches(model: Any, engine: Any, m: int, want: tuple[float, dict[str, Any]], what: str) -> None:
    """The resumed engine's next batch gives the uninterrupted run's loss and parameters; then destroyed."""
    want_loss, want_params = want
    got = float(engine.train_batch(_step_data(1, m, engine.dp_world_size, engine.topology.coord.dp)))
    assert abs(got - want_loss) < 1e-5, (what, got, want_loss)
    for name, p in model.named_parameters():
        torch.testing.assert_close(engine.strategy.full_fp32_param(p).cpu(), want_params[name], rtol=1e-4, atol=1e-5)
    assert engine.global_steps == 2, what
    engine.destroy()


def resume(world: int, directory: str) -> list[str]:
    """A pp=2 checkpoint (ZeRO-2: sharded optimizer state) resumed on pp=2 and on pp=1 x dp=2 gives the
    uninterrupted run's next loss and parameters; no conversion step."""
    want = _saved_then_next(2, 2, world, directory, "t")
    done = []
    for pp, zero in ((2, 2), (1, 1)):
        model, engine, m = _resumed(pp, zero, directory, "t", world)
        _next_batch_matches(model, engine, m, want, f"pp{pp}")
        done.append(f"pp{pp}")
    return done


def resume_across_grids(world: int, directory: str) -> list[str]:
    """(stages, dp) = (2, 2) at ZeRO-2 saved after one batch; resumed on (4, 1) and (1, 4) the next batch
    gives the uninterrupted run's loss and parameters; each of those saves again and (2, 2) resumes from
    it (back) with the same result."""
    want = _saved_then_next(2, 2, world, directory, "grid22")
    done = []
    for pp, zero in ((4, 1), (1, 2)):
        model, engine, m = _resumed(pp, zero, directory, "grid22", world)
        engine.save_checkpoint(directory, tag=f"grid{pp}")  # before training: the same state, this grid's files
        _next_batch_matches(model, engine, m, want, f"pp{pp} from (2, 2)")
        model, engine, m = _resumed(2, 2, directory, f"grid{pp}", world)
        _next_batch_matches(model, engine, m, want, f"(2, 2) back from pp{pp}")
        done.append(f"pp{pp}-and-back")
    return done


def _transfers(rank: int) -> None:
    """Stage-to-stage messages: shapes and tuple arity change from one message to the next with no
    set-up; a gradient whose shape does not match is an error naming both stages and both shapes."""
    import pytest

    from deepshard.pipe.p2p import PipeCommError, StageLink, TensorMeta

    link = StageLink(stage=rank, rank=rank, device=torch.device("cpu"))
    shapes = [(2, 3), (5,), (1, 4, 2)]
    if rank == 0:
        for shape in shapes:
            link.send(torch.ones(shape), 1)
        link.send((torch.zeros(2, 2), torch.arange(3)), 1)
        link.send(torch.zeros(2, 3), 1)
        link.wait_sends()
        return
    for shape in shapes:
        tensors, metas, is_tuple = link.recv(0, "activations")
        assert not is_tuple and tuple(tensors[0].shape) == shape and bool(tensors[0].eq(1).all())
    tensors, metas, is_tuple = link.recv(0, "activations")
    assert is_tuple and tensors[1].dtype == torch.int64 and tensors[1].tolist() == [0, 1, 2]
    with pytest.raises(PipeCommError, match=r"stage 1 \(rank 1\) expected output gradients shaped .*\(2, 4\).* from "
                                            r"stage 0 \(rank 0\) but received .*\(2, 3\)"):
        link.recv(0, "output gradients", [TensorMeta((2, 4), torch.float32, False)], src_stage=0)
    torch.distributed.recv(torch.empty(2, 3), 0)  # drain the refused payload so the sender can finish


def _posted_ahead(rank: int) -> None:
    """Batches with receives posted ahead (as the engine runs them): the payload lands in the posted buffers
    while the shapes stay the same; a change of shape or arity is received after the sender's throwaway,
    with the right values; the next batch posts for the last shapes; counts that do not match are errors."""
    import pytest

    from deepshard.pipe.p2p import PipeCommError, StageLink

    link = StageLink(stage=rank, rank=rank, device=torch.device("cpu"), post_ahead=True)
    batch1 = [torch.full((4, 3), 1.0), torch.full((4, 3), 2.0), torch.full((5,), 3.0),
              (torch.full((2, 2), 4.0), torch.arange(3)), torch.full((5,), 5.0)]
    batch2 = [torch.full((5,), 6.0), torch.full((5,), 7.0)]
    if rank == 0:
        for batch in (batch1, batch2, batch2[:1]):
            link.begin({})
            for value in batch:
                link.send(value, 1)
            link.end()
        return
    for batch in (batch1, batch2):
        link.begin({0: len(batch)})
        for value in batch:
            tensors, _, is_tuple = link.recv(0, "activations")
            want = list(value) if isinstance(value, tuple) else [value]
            assert is_tuple == isinstance(value, tuple) and len(tensors) == len(want)
            assert all(t.dtype == w.dtype and torch.equal(t, w) for t, w in zip(tensors, want))
        link.end()
    # batch 1: the first message posts its header only, then 1 hit and 3 changes; batch 2: 2 hits
    assert (link.received_ahead, link.throwaways) == (3, 3)
    link.begin({0: 1})  # a batch that ends before its announced message was received
    with pytest.raises(PipeCommError, match=r"announced but not received \(by rank: \{0: 1\}\)"):
        link.end()
    with pytest.raises(PipeCommError, match="out of step"):
        link.begin({0: 1})
    # the receive posted for it is still held (never dropped while gloo may write into it): drain it
    assert torch.equal(link.recv(0, "activations")[0][0], torch.full((5,), 6.0))
