"""PipelineModule, LayerSpec, TiedLayerSpec and partitioning, with no process group (``stage_id=``)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import deepshard as deepspeed
from deepshard.pipe import LayerSpec, PartitionError, PipelineModule, TiedLayerSpec
from deepshard.pipe.partition import balanced_parts, type_weights, uniform_parts


class Counted(nn.Linear):
    """A Linear that counts its constructions (to prove LayerSpecs are built on their stage only)."""

    built = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.weight.device.type != "meta":
            Counted.built += 1


def test_balanced_parts_minimise_the_slowest_stage_and_never_leave_a_stage_empty() -> None:
    assert balanced_parts([1, 1, 1, 1], 2) == [0, 2, 4]
    assert balanced_parts([10, 1, 1, 1, 1, 10], 3) == [0, 1, 5, 6]
    assert balanced_parts([0, 0, 5, 0], 4) == [0, 1, 2, 3, 4]  # zero weights still get a stage each
    # heavy head: the heaviest stage is as light as it can be (max 7), not an even spread of counts
    parts = balanced_parts([1, 1, 1, 1, 1, 1, 7], 2)
    assert parts == [0, 6, 7]
    assert uniform_parts(7, 3) == [0, 3, 5, 7]
    with pytest.raises(PartitionError, match="without an empty stage"):
        balanced_parts([1, 1], 3)


def test_type_regex_weights() -> None:
    assert type_weights(["Embedding", "Block", "Block", "Head"], "block") == [0, 1, 1, 0]
    with pytest.raises(PartitionError, match="matches none"):
        type_weights(["Linear"], "Block")


def _specs(n: int = 6) -> list:
    return [LayerSpec(Counted, 4, 4) for _ in range(n)]


def test_layer_specs_are_built_only_on_their_stage() -> None:
    Counted.built = 0
    module = PipelineModule(_specs(6), num_stages=3, stage_id=1, partition_method="uniform")
    assert Counted.built == 2  # parameter counting builds on the meta device only
    assert module.partitions() == [0, 2, 4, 6]
    assert sorted(name.split(".")[0] for name, _ in module.named_parameters()) == ["2", "2", "3", "3"]
    assert [module.stage_owner(i) for i in range(6)] == [0, 0, 1, 1, 2, 2]
    Counted.built = 0
    PipelineModule(_specs(6), num_stages=3, stage_id=0)  # default 'parameters' partitioning
    assert Counted.built == 2


def test_parameters_method_balances_parameter_counts() -> None:
    layers = [LayerSpec(nn.Linear, 2, 2), LayerSpec(nn.Linear, 2, 2), LayerSpec(nn.Linear, 2, 2),
              LayerSpec(nn.Linear, 16, 16)]
    assert PipelineModule(layers, num_stages=2, stage_id=0).partitions() == [0, 3, 4]
    assert PipelineModule(layers, num_stages=2, stage_id=0, partition_method="uniform").partitions() == [0, 2, 4]
    typed = [LayerSpec(nn.Embedding, 8, 4)] + [LayerSpec(nn.Linear, 4, 4) for _ in range(4)]
    mod = PipelineModule(typed, num_stages=2, stage_id=0, partition_method="type:linear")
    assert mod.partitions() == [0, 3, 5]


def test_profile_partitioning_times_layers() -> None:
    layers = [LayerSpec(nn.Linear, 8, 8) for _ in range(3)] + [LayerSpec(nn.Linear, 8, 512), LayerSpec(nn.Linear, 512, 8)]
    with pytest.raises(PartitionError, match="partition_sample"):
        PipelineModule(layers, num_stages=2, stage_id=0, partition_method="profile")
    mod = PipelineModule(layers, num_stages=2, stage_id=0, partition_method="profile",
                         partition_sample=torch.randn(64, 8))
    parts = mod.partitions()
    assert parts[0] == 0 and parts[-1] == 5 and 1 <= parts[1] <= 4


def test_seed_layers_make_any_stage_build_the_same_values_as_the_whole_model() -> None:
    whole = PipelineModule(_specs(4), num_stages=1, seed_layers=True)
    last = PipelineModule(_specs(4), num_stages=2, stage_id=1, seed_layers=True, partition_method="uniform")
    for name, p in last.named_parameters():
        torch.testing.assert_close(p, dict(whole.named_parameters())[name], rtol=0, atol=0)


def test_tied_layers_share_one_module_and_forward_fn() -> None:
    layers = [TiedLayerSpec("embed", nn.Embedding, 10, 4), LayerSpec(nn.Linear, 4, 4),
              TiedLayerSpec("embed", nn.Embedding, 10, 4, forward_fn=lambda m, x: x @ m.weight.t())]
    whole = PipelineModule(layers, num_stages=1)
    assert len(list(whole.parameters())) == 3  # one embedding, one linear
    out = whole(torch.tensor([[1, 2]]))
    assert out.shape == (1, 2, 10)
    assert whole.tied_stages() == {"embed": [0]}
    split = PipelineModule(layers, num_stages=2, stage_id=1, partition_method="uniform")
    assert split.partitions() == [0, 2, 3]
    assert split.tied_stages() == {"embed": [0, 1]}
    assert [p.shape for p in split.tied_parameters("embed")] == [torch.Size([10, 4])]


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    torch.manual_seed(0)
    plain = PipelineModule([nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh()], num_stages=1)
    ckpt = PipelineModule([nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh()], num_stages=1,
                          activation_checkpoint_interval=2)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(3, 4)
    plain(x).sum().backward()
    ckpt(x).sum().backward()
    for a, b in zip(plain.parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    # DeepSpeed's function, inputs kept in host memory
    from deepshard.checkpointing import CheckpointOptions

    cpu = deepspeed.checkpointing.checkpoint
    ckpt.activation_checkpoint_func = lambda fn, *a: cpu(fn, *a, options=CheckpointOptions(cpu_checkpointing=True))
    ckpt.zero_grad()
    ckpt(x).sum().backward()
    for a, b in zip(plain.parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_checkpointing_configure_sets_the_default_options(monkeypatch: pytest.MonkeyPatch) -> None:
    import deepshard.checkpointing as ckpt

    monkeypatch.setattr(ckpt._Configured, "options", None)  # restored after the test
    kept_on_cpu = []
    real = torch.autograd.graph.save_on_cpu

    def spy(*args: object, **kwargs: object) -> object:
        kept_on_cpu.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", spy)
    layer = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    layer(x).tanh().sum().backward()
    want = layer.weight.grad.clone()
    assert not deepspeed.checkpointing.is_configured()
    deepspeed.checkpointing.checkpoint(lambda t: layer(t).tanh(), x)
    assert kept_on_cpu == []
    deepspeed.checkpointing.configure(None, deepspeed_config={"train_batch_size": 1, "activation_checkpointing": {
        "cpu_checkpointing": True}})
    assert deepspeed.checkpointing.is_configured()
    layer.zero_grad()
    deepspeed.checkpointing.checkpoint(lambda t: layer(t).tanh(), x).sum().backward()
    assert kept_on_cpu == [True]
    torch.testing.assert_close(layer.weight.grad, want)
    deepspeed.checkpointing.configure(None, checkpoint_in_cpu=False)  # arguments override, defaults otherwise
    deepspeed.checkpointing.checkpoint(lambda t: layer(t).tanh(), x)
    assert kept_on_cpu == [True]


def test_errors_and_deepspeed_import_path() -> None:
    assert deepspeed.pipe.PipelineModule is PipelineModule
    assert deepspeed.pipe.LayerSpec is LayerSpec and deepspeed.pipe.TiedLayerSpec is TiedLayerSpec
    with pytest.raises(ValueError, match="num_stages"):
        PipelineModule(_specs(2))
    # no process group: "start torch.distributed"; a world of 1 left by an earlier test: "must divide"
    with pytest.raises(ValueError, match="torch.distributed|must divide the world size 1"):
        PipelineModule(_specs(2), num_stages=2)
    with pytest.raises(TypeError, match="nn.Module subclass"):
        LayerSpec(lambda: None)
    with pytest.raises(PartitionError, match="not known"):
        PipelineModule(_specs(2), num_stages=1, partition_method="best-effort")


def test_chunks_interleave_virtual_stages_over_the_stages() -> None:
    """8 layers, 2 stages x 2 chunks: virtual stage vs on stage vs % 2; stage 1 holds layers 2-3 and 6-7."""
    specs = [LayerSpec(nn.Linear, 4, 4) for _ in range(8)]
    one = PipelineModule(specs, num_stages=2, stage_id=1, partition_method="uniform", num_chunks=2, seed_layers=True)
    assert one.partitions() == [0, 2, 4, 6, 8]
    assert sorted(int(name.split(".")[0]) for name, _ in one.named_parameters()) == [2, 2, 3, 3, 6, 6, 7, 7]
    assert [one.stage_owner(i) for i in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    x = torch.randn(3, 4)
    whole = PipelineModule(specs, num_stages=1, stage_id=0, seed_layers=True)
    torch.testing.assert_close(one(whole.forward_funcs[1](whole.forward_funcs[0](x)), chunk=0),
                               whole.forward_funcs[3](whole.forward_funcs[2](whole.forward_funcs[1](whole.forward_funcs[0](x)))))
    with pytest.raises(ValueError, match="needs num_stages >= 2"):
        PipelineModule(specs, num_stages=1, stage_id=0, num_chunks=2)
    with pytest.raises(ValueError, match="integer >= 1"):
        PipelineModule(specs, num_stages=2, stage_id=0, num_chunks=0)


def test_process_topology_maps_named_axes_row_major_as_deepspeed_documents() -> None:
    from deepshard.pipe.grid import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology, dims_of

    topo = ProcessTopology(axes=["pipe", "data", "model"], dims=[2, 2, 2])
    assert topo.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.get_axis_comm_lists("sequence") == []
    assert topo.filter_match(pipe=0, data=1) == [2, 3]
    assert topo.get_rank(pipe=1, data=0, model=1) == 5 and topo.get_coord(5) == (1, 0, 1)
    assert topo.get_rank_repr(3) == "model_01" and topo.get_rank_repr(3, omit_axes=["pipe"]) == "data_01-model_01"
    assert topo.get_axis_list("data", 1) == [2, 3, 6, 7] and topo.world_size() == 8 and topo.get_dim("x") == 0
    with pytest.raises(ValueError, match="every axis"):
        topo.get_rank(pipe=0)
    assert PipeDataParallelTopology(num_pp=2, num_dp=3).get_coord(4) == (1, 1)
    dims = dims_of(PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=3))
    assert (dims.pp, dims.dp, dims.tp) == (2, 3, 2)
    with pytest.raises(ValueError, match="pipe x data x model"):
        dims_of(ProcessTopology(axes=["data", "pipe"], dims=[2, 2]))


def test_module_without_a_process_group_describes_its_grid_and_has_no_mpu() -> None:
    module = PipelineModule(_specs(4), num_stages=2, stage_id=1, partition_method="uniform")
    assert module.mpu() is None and module.topology().get_dim("pipe") == 2


def test_checkpoint_interval_setter_rebuilds_the_block_decisions() -> None:
    """Blocks qualify by holding parameters; the setter recomputes the cached decisions for the new interval
    (what forward zips the blocks against), and refuses a negative interval."""
    layers = [nn.ReLU() for _ in range(4)] + [nn.Linear(4, 4) for _ in range(4)]
    module = PipelineModule(layers, num_stages=1, activation_checkpoint_interval=4)
    module._precompute_checkpointable_values()
    assert module.is_checkpointable_results == [False, True]
    module.set_checkpoint_interval(3)  # blocks [0:3] [3:6] [6:8]
    assert module.activation_checkpoint_interval == 3
    assert module.is_checkpointable_results == [False, True, True]
    module.set_checkpoint_interval(0)
    assert module.is_checkpointable_results == []
    with pytest.raises(ValueError, match="block size >= 1, or 0"):
        module.set_checkpoint_interval(-1)


def _reentrant(fn, *args):  # a user's own recompute function (DeepSpeed assumes such a one is reentrant)
    from torch.utils.checkpoint import checkpoint

    return checkpoint(fn, *args, use_reentrant=True)


def test_use_reentrant_picks_the_function_and_whether_inputs_need_grad() -> None:
    """``pipeline.use_reentrant: false`` installs ``non_reentrant_checkpoint`` even with checkpointing off
    (a later ``set_checkpoint_interval`` uses it); a reentrant function of the user's own makes the first
    stage's inputs require grad, so the first block's parameters get the gradients plain PyTorch gives."""
    from deepshard.checkpointing import non_reentrant_checkpoint

    cfg = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "gradient_clipping": 0.0,
           "pipeline": {"use_reentrant": False}}
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)]
    reference = copy.deepcopy(nn.Sequential(*layers))
    engine, *_ = deepspeed.initialize(model=PipelineModule(list(layers), num_stages=1, loss_fn=nn.MSELoss()),
                                      config=cfg)
    assert engine.module.activation_checkpoint_func is non_reentrant_checkpoint
    engine.module.set_checkpoint_interval(1)
    assert not engine._reentrant_activation_checkpointing()
    engine.module.activation_checkpoint_func = _reentrant
    assert engine._reentrant_activation_checkpointing()
    x, y = torch.randn(2, 4), torch.randn(2, 1)
    engine.train_batch(iter([(x, y)]))
    nn.MSELoss()(reference(x), y).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    for (name, got), want in zip(engine.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.detach(), want.detach(), msg=lambda m: f"{name}: {m}")
    assert not x.requires_grad  # the engine marked its own copy, not the caller's tensor
