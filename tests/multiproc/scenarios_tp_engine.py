"""Per-rank bodies for tensor parallelism inside the engine: ``"tensor_parallel": {"autotp_size": 2}`` on a
dp=2 x tp=2 grid with ZeRO 0-3 against single-process PyTorch; the checkpoints loaded at tp=4 and into a
plain dp=4 engine; ``save_16bit_model`` writing the full model."""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import deepshard
from deepshard.tp import shard_of
from deepshard.tp.params import tp_split_dim
from tests.multiproc.device import rank_device
from tests.multiproc.tp_models import LlamaLike, LlamaLikeConfig

STEPS, MICRO, GAS = 3, 1, 2
GLOBAL = MICRO * GAS * 2  # dp = 2
CLIP = 0.5


def model_config() -> LlamaLikeConfig:
    return LlamaLikeConfig(num_key_value_heads=4)  # tp=4 must divide the kv heads too


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(21)
    return [torch.randint(0, 32, (GLOBAL, 9), generator=g) for _ in range(STEPS)]


def config(stage: int, tp: int, dtype: str = "fp32") -> dict[str, Any]:
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
                           "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
                           "gradient_clipping": CLIP, "zero_optimization": {"stage": stage}}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch: the whole global batch per step, torch's clipping."""
    torch.manual_seed(0)
    model = LlamaLike(model_config())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for ids in batches():
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def local_weights(engine: Any) -> dict[str, torch.Tensor]:
    """This rank's tensor-parallel slice of each parameter (fp32 masters where kept), gathered over dp, on the
    CPU (where the reference is)."""
    return {name: engine.strategy.full_fp32_param(p).cpu().clone() for name, p in engine.module.named_parameters()}


def slice_of(full: dict[str, torch.Tensor], engine: Any, tp: Any) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in engine.module.named_parameters():
        dim = tp_split_dim(p)
        out[name] = full[name] if dim is None else shard_of(full[name], dim, tp.rank, tp.size)
    return out


def train(stage: int, dtype: str = "fp32") -> tuple[Any, list[float]]:
    torch.manual_seed(0)
    model = LlamaLike(model_config())
    if stage == 2:  # DeepSpeed's API instead of the config key: the grid and the split come from it
        engine, *_ = deepshard.initialize(model=deepshard.tp_model_init(model, tp_size=2, dtype=None),
                                          config=config(stage, 1, dtype))
    else:
        engine, *_ = deepshard.initialize(model=model, config=config(stage, 2, dtype))
    assert engine.topology.dims.tp == 2 and engine.dp_world_size == 2
    dp_rank, losses, device = engine.topology.coord.dp, [], rank_device()  # the CPU unless --device cuda
    for ids in batches():
        total = torch.zeros(1, device=device)
        for k in range(GAS):
            start = (k * 2 + dp_rank) * MICRO
            chunk = ids[start:start + MICRO].to(device)
            loss = engine(chunk[:, :-1], chunk[:, 1:])
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)  # 2 tp copies of each dp rank's loss
        losses.append(float(total) / (GAS * 4))
    return engine, losses


def reload(path: str, stage: int, tp: int) -> dict[str, float]:
    """Load the dp=2 x tp=2 checkpoint at tp=``tp`` (dp = 4 / tp) and compare with the reference."""
    _, ref = reference()
    torch.manual_seed(5)  # other initial values: the load must replace them
    engine, *_ = deepshard.initialize(model=LlamaLike(model_config()), config=config(stage, tp))
    engine.load_checkpoint(path, tag="t")
    mine = local_weights(engine)
    want = slice_of(ref, engine, engine.topology.tp)
    err = max(float((mine[k] - want[k]).abs().max()) for k in want)
    steps = engine.global_steps
    engine.destroy()
    return {"err": err, "steps": steps}


def tp_engine_world(rank: int, world: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ref_losses, ref = reference()
    for stage in (0, 1, 2, 3):
        engine, losses = train(stage)
        mine = local_weights(engine)
        want = slice_of(ref, engine, engine.topology.tp)
        path = os.path.join(tmp, f"stage{stage}")
        engine.save_checkpoint(path, tag="t")
        out[f"z{stage}"] = {"loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                            "params": max(float((mine[k] - want[k]).abs().max()) for k in want),
                            "tp_bytes": engine.comms_logger.summary().get("tp:all_reduce", {}).get("bytes", 0)}
        engine.destroy()
    out["reload_tp4"] = reload(os.path.join(tmp, "stage1"), 1, 4)
    out["reload_plain"] = reload(os.path.join(tmp, "stage2"), 2, 1)
    out["reload_tp2_z3"] = reload(os.path.join(tmp, "stage3"), 3, 2)
    engine, losses = train(1, "bf16")
    engine.destroy()
    out["bf16"] = max(abs(a - b) / b for a, b in zip(losses, ref_losses))
    out["megatron_gpt"] = megatron_gpt(tmp)
    from tests.multiproc.scenarios_placement import megatron_attribute_layers

    out["megatron_attrs"] = megatron_attribute_layers(rank)
    out["hf_llama"] = hf_llama(tmp)
    return out


# ------------------------------------------------------- a model written with the Megatron layers; HF LLaMA
def _run(engine: Any, loss_of: Any) -> list[float]:
    dp_rank, losses, device = engine.topology.coord.dp, [], rank_device()  # the CPU unless --device cuda
    for ids in batches():
        total = torch.zeros(1, device=device)
        for k in range(GAS):
            start = (k * 2 + dp_rank) * MICRO
            loss = loss_of(engine, ids[start:start + MICRO].to(device))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(float(total) / (GAS * dist.get_world_size()))
    return losses


def _reference(model: torch.nn.Module, loss_of: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for ids in batches():
        loss = loss_of(model, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _gpt_loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(ids[:, :-1], ids[:, 1:])


def _compare_full(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    if set(state) != set(ref):
        return float("inf")
    return max(float((state[k].float() - ref[k].float()).abs().max()) for k in ref)


def megatron_gpt(tmp: str) -> dict[str, Any]:
    """A GPT written with deepshard.tp's layers (fused qkv, tied vocab-parallel embedding) at tp=2 x dp=2,
    ZeRO-1, built on a grid the script creates and passes as ``mpu``; reloaded at tp=4; its
    ``save_16bit_model`` file against the plain model's state dict."""
    from deepshard.topology import ParallelDims, Topology
    from tests.multiproc.tp_models import GPTConfig, PlainGPT, TPGPT

    cfg = GPTConfig()
    torch.manual_seed(0)
    ref_losses, ref = _reference(PlainGPT(cfg), _gpt_loss)
    topo = Topology.build(ParallelDims(dp=2, tp=2))
    torch.manual_seed(0)
    engine, *_ = deepshard.initialize(model=TPGPT(cfg, topo.tp), config=config(1, 1), mpu=topo)
    losses = _run(engine, lambda e, ids: e(ids[:, :-1], ids[:, 1:]))
    path = os.path.join(tmp, "gpt")
    engine.save_checkpoint(path, tag="t")
    engine.save_16bit_model(path, "full.bin")
    engine.destroy()
    saved = torch.load(os.path.join(path, "full.bin"), map_location="cpu") if dist.get_rank() == 0 else ref
    topo4 = Topology.build(ParallelDims(dp=1, tp=4))
    torch.manual_seed(3)
    engine4, *_ = deepshard.initialize(model=TPGPT(cfg, topo4.tp), config=config(1, 1), mpu=topo4)
    engine4.load_checkpoint(path, tag="t")
    mine, want = local_weights(engine4), {}
    for name, p in engine4.module.named_parameters():
        dim = tp_split_dim(p)
        want[name] = ref[name] if dim is None else shard_of(ref[name], dim, topo4.tp.rank, 4, p.tp_fused_parts)
    engine4.destroy()
    torch.manual_seed(0)  # sequence parallelism (SequenceParallel norms) under ZeRO-3
    engine_sp, *_ = deepshard.initialize(model=TPGPT(cfg, topo.tp, sp=True), config=config(3, 1), mpu=topo)
    sp_losses = _run(engine_sp, lambda e, ids: e(ids[:, :-1], ids[:, 1:]))
    engine_sp.destroy()
    fp32 = ref
    if dist.get_rank() == 0:
        from deepshard.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        fp32 = get_fp32_state_dict_from_zero_checkpoint(path, tag="t")
    return {"loss": max(abs(a - b) for a, b in zip(losses, ref_losses)), "full_16bit": _compare_full(saved, ref),
            "zero_to_fp32": _compare_full(fp32, ref),
            "sp_z3_loss": max(abs(a - b) for a, b in zip(sp_losses, ref_losses)),
            "reload_tp4": max(float((mine[k] - want[k]).abs().max()) for k in want)}


def hf_llama(tmp: str) -> dict[str, Any]:
    """A transformers LLaMA under automatic TP (tp=2 x dp=2, ZeRO-0) vs single-process; its
    ``save_16bit_model`` output loaded by ``from_pretrained``."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return {"skipped": "transformers is not installed"}
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, bos_token_id=0, eos_token_id=1, attn_implementation="eager")
    loss_of = (lambda m, ids: m(input_ids=ids, labels=ids).loss)
    torch.manual_seed(0)
    ref_losses, ref = _reference(LlamaForCausalLM(cfg), loss_of)
    torch.manual_seed(0)
    engine, *_ = deepshard.initialize(model=LlamaForCausalLM(cfg), config=config(0, 2))
    losses = _run(engine, lambda e, ids: e(input_ids=ids, labels=ids).loss)
    path = os.path.join(tmp, "hf")
    if dist.get_rank() == 0:
        cfg.save_pretrained(path)
    engine.save_16bit_model(path, "model.safetensors")
    engine.destroy()
    loaded = LlamaForCausalLM.from_pretrained(path).state_dict() if dist.get_rank() == 0 else ref
    return {"loss": max(abs(a - b) for a, b in zip(losses, ref_losses)), "from_pretrained": _compare_full(loaded, ref)}
