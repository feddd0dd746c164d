"""Sequence-parallel scenarios (run by test_sp.py): each spawned world runs many checks and returns the
errors against one process."""
from __future__ import annotations

from typing import Any

import torch

from deepshard.sp import SequenceParallel
from deepshard.topology import ParallelDims, Topology

# (mode, ulysses_size, heads, kv_heads, seq_len, causal, balance)
ATTENTION_CASES_SP4 = [
    ("ulysses", None, 8, 4, 16, True, True),
    ("ulysses", None, 8, 2, 16, True, True),    # GQA: kv heads < sp, repeated
    ("ulysses", None, 6, 2, 13, True, True),    # uneven heads (padded) and length (padded, masked)
    ("ulysses", None, 5, 5, 15, False, True),   # non-causal: padding keys masked
    ("ring", None, 4, 2, 16, True, True),
    ("ring", None, 4, 2, 16, True, False),
    ("ring", None, 3, 1, 13, True, True),
    ("ring", None, 4, 4, 11, False, True),
    ("hybrid", 2, 6, 2, 16, True, True),        # 6 heads over a Ulysses pair, ring of 2
    ("hybrid", 2, 3, 1, 19, True, True),
]
ATTENTION_CASES_SP2 = [
    ("ulysses", None, 4, 2, 16, True, True),
    ("ulysses", None, 3, 3, 9, True, True),
    ("ring", None, 4, 2, 16, True, True),
    ("ring", None, 2, 1, 7, True, True),
]


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _one_case(sp: SequenceParallel, case: tuple, seed: int) -> dict[str, float]:
    _, _, h, hk, s, causal, _ = case
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, n, s, 8, generator=g, dtype=torch.float64) for n in (h, hk, hk))
    dout = torch.randn(2, h, s, 8, generator=g, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = reference_attention(*full, causal)
    want.backward(dout)
    mine = [sp.shard(t, dim=2).clone().requires_grad_() for t in (q, k, v)]
    got = sp.attention(*mine, seq_len=s, causal=causal)
    got.backward(sp.shard(dout, dim=2))
    valid = sp.layout(s).positions(sp.rank) < s  # padded rows are nobody's tokens
    errors = {"out": float((got - sp.shard(want.detach(), dim=2))[:, :, valid].abs().max())}
    for name, a, b in zip("qkv", mine, full):
        errors[f"d{name}"] = float((a.grad - sp.shard(b.grad, dim=2))[:, :, valid].abs().max())
    return errors


# (mode, ulysses_size): packed documents in one sample, padding inside the other (13 tokens, 6 heads over 2)
SEGMENT_CASES = [("ulysses", None), ("ring", None), ("hybrid", 2)]


def _segment_case(sp: SequenceParallel, seed: int) -> dict[str, float]:
    from deepshard.sp.softmax_merge import segment_ids
    from tests.unit.test_sp_math import segment_reference

    s = 13
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1, 2], list(range(s))])
    mask = torch.tensor([[1] * s, [0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0]])
    seg = segment_ids(positions, mask)
    assert seg is not None
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, n, s, 8, generator=g, dtype=torch.float64) for n in (6, 2, 2))
    dout = torch.randn(2, 6, s, 8, generator=g, dtype=torch.float64) * (seg >= 0)[:, None, :, None]
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    segment_reference(*full, seg).backward(dout)
    want = segment_reference(q, k, v, seg)
    batch = sp.shard_batch({"input_ids": torch.zeros(2, s, dtype=torch.long), "position_ids": positions,
                            "attention_mask": mask})
    mine = [sp.shard(t, dim=2).clone().requires_grad_() for t in (q, k, v)]
    got = sp.attention(*mine, seq_len=s, segments=batch["segments"])
    got.backward(sp.shard(dout, dim=2))
    valid = (sp.shard(seg, dim=1, pad_value=-1) >= 0)[:, None, :, None]  # [b, 1, local, 1]
    errors = {"out": float(((got - sp.shard(want, dim=2)) * valid).abs().max()),
              "positions": float((batch["position_ids"] - sp.shard(positions)).abs().max())}
    for name, a, b in zip("qkv", mine, full):
        errors[f"d{name}"] = float((a.grad - sp.shard(b.grad, dim=2)).abs().max())
    return errors


def _dropout_case(sp: SequenceParallel) -> float:
    """The largest difference between this rank's ``sp.dropout`` and one process's mask on the same tokens."""
    from deepshard.sp.dropout import positional_dropout

    x = torch.randn(2, 300, 4, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(11)
    whole = positional_dropout(x, 0.4, torch.arange(300))
    torch.manual_seed(11)
    got = sp.dropout(sp.shard(x), 0.4, 300)
    real = sp.layout(300).positions(sp.rank) < 300
    return float((got[:, real] - sp.shard(whole)[:, real]).abs().max())


def attention_world(rank: int, world: int) -> dict[str, Any]:
    """sp=4 (every mode, and packed/padded samples) and dp=2 x sp=2 on one world of 4."""
    out: dict[str, Any] = {}
    topo4 = Topology.build(ParallelDims(sp=4))
    for i, case in enumerate(ATTENTION_CASES_SP4):
        sp = SequenceParallel.build(topo4, case[0], case[1], balance=case[6])
        out[("sp4",) + case] = _one_case(sp, case, seed=i)
    for i, (mode, u) in enumerate(SEGMENT_CASES):
        sp = SequenceParallel.build(topo4, mode, u)
        out[("segments", mode)] = _segment_case(sp, seed=50 + i)
        out[("dropout", mode)] = _dropout_case(sp)
    topo2 = Topology.build(ParallelDims(dp=2, sp=2))
    for i, case in enumerate(ATTENTION_CASES_SP2):
        sp = SequenceParallel.build(topo2, case[0], case[1], balance=case[6])
        out[("sp2",) + case] = _one_case(sp, case, seed=100 + i + topo2.coord.dp)
    out["labels"] = sorted(topo4.world.logger.ops)
    return out


# ----------------------------------------------------------------------------------------- training
SEQ, STEPS, CLIP = 13, 3, 0.5


TP_RULES = [{"patterns": [r"\.q$", r"mlp\.0$"], "partition_type": "column"},
            {"patterns": [r"\.kv$"], "partition_type": "column", "shape": [8, 8]},  # [k | v], each split by heads
            {"patterns": [r"\.o$", r"mlp\.2$"], "partition_type": "row"}]
"""Automatic TP of TinyLM (its layer names are not Hugging Face's): q, kv by heads, o and the MLP."""


def lm_config(stage: int, sp: int, gas: int, mode: str = "ulysses", ulysses_size: int | None = None,
              tp: int = 1) -> dict:
    section: dict[str, Any] = {"mode": mode}
    if ulysses_size:
        section["ulysses_size"] = ulysses_size
    extra: dict[str, Any] = {}
    if tp > 1:
        extra["tensor_parallel"] = {"autotp_size": tp, "partition_config": {"layer_specs": TP_RULES}}
    return {**extra, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage}, "sequence_parallel_size": sp, "sequence_parallel": section}


def train_lm(config: dict, steps: int, start: int = 0, ckpt: bool = False, load: str | None = None,
             save: str | None = None) -> dict[str, Any]:
    """Train TinyLM through the engine; each dp rank takes samples in order (sample = micro-step * dp + d)."""
    import deepshard
    from tests.multiproc.sp_models import make_lm, make_samples

    model = make_lm(activation_checkpointing=ckpt)
    engine, *_ = deepshard.initialize(model=model, config=config)
    model.sp = engine.sequence_parallel
    if load is not None:
        engine.load_checkpoint(load)
    dp, gas = engine.dp_world_size, engine.gradient_accumulation_steps()
    samples = make_samples(64, SEQ)
    losses, norms = [], []
    for step in range(start, start + steps):
        step_loss = 0.0
        for micro in range(gas):
            ids = samples[(step * gas + micro) * dp + engine.topology.coord.dp].unsqueeze(0)
            batch = model.sp.shard_batch({"input_ids": ids, "labels": ids})
            logits = engine(batch["input_ids"], batch["position_ids"], batch["seq_len"])
            loss = model.sp.loss(logits, batch["shift_labels"])
            engine.backward(loss)
            engine.step()
            step_loss += float(loss.detach()) / gas
        losses.append(step_loss)
        norms.append(engine.get_global_grad_norm())
    if save is not None:
        engine.save_checkpoint(save)
    weights = _full_weights(engine)
    split = sum(1 for m in engine.module.modules() if type(m).__name__ in ("ColumnParallelLinear", "RowParallelLinear"))
    engine.destroy()
    return {"losses": losses, "weights": weights, "norms": norms, "tp": engine.topology.dims.tp, "tp_layers": split}


def _full_weights(engine: Any) -> dict[str, torch.Tensor]:
    if engine.zero_optimization_stage() == 3:
        state = engine._zero3_consolidated_16bit_state_dict()
        return {k: v.float() for k, v in (state or {}).items()}
    from deepshard.tp.consolidate import gather_tensor_parallel

    state = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    return gather_tensor_parallel(state, engine.module, engine.topology.tp)  # whole tensors under TP


def training_world(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """dp2 x sp2 Ulysses at ZeRO 1 (accumulation 2, activation checkpointing) and ZeRO 3; sp4 ring and
    hybrid 2x2 at ZeRO 2; tp2 x sp2 Ulysses at ZeRO 1 (automatic TP, accumulation 2); a dp2 x sp2
    checkpoint resumed at sp4 (ring) for one more step."""
    out: dict[str, Any] = {}
    out["z1_ulysses_dp2sp2"] = train_lm(lm_config(1, 2, 2), STEPS, ckpt=True)
    out["z3_ulysses_dp2sp2"] = train_lm(lm_config(3, 2, 1), STEPS, save=f"{tmp}/ckpt")
    out["z2_ring_sp4"] = train_lm(lm_config(2, 4, 1, "ring"), STEPS)
    out["z2_hybrid_sp4"] = train_lm(lm_config(2, 4, 2, "hybrid", 2), STEPS)
    # automatic TP x Ulysses: each tp rank's 3 query heads and 1 key/value head over its sp pair (uneven)
    out["z1_ulysses_tp2sp2"] = train_lm(lm_config(1, 2, 2, tp=2), STEPS)
    out["resume_sp4"] = train_lm(lm_config(3, 4, 2, "ring"), 1, start=STEPS, load=f"{tmp}/ckpt")
    return out


# ------------------------------------------------------------------------ Hugging Face (ALST)
HF_STEPS = 2


def tiny_llama(attn: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                         use_cache=False)  # training: no cache (transformers then reads packed documents)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def hf_samples(seq_len: int) -> torch.Tensor:
    return torch.randint(0, 64, (16, seq_len), generator=torch.Generator().manual_seed(9))


def hf_positions(seq_len: int, packed: bool) -> torch.Tensor:
    """[1, seq_len] position ids: one document, or packed documents of 5, 4 and the rest (restarting at 0)."""
    if not packed:
        return torch.arange(seq_len).unsqueeze(0)
    return torch.cat([torch.arange(5), torch.arange(4), torch.arange(seq_len - 9)]).unsqueeze(0)


def alst_script(attn: str, sp_size: int, stage: int, seq_len: int, gather_loss: bool, mode: str = "ulysses",
                packed: bool = False) -> dict[str, Any]:
    """DeepSpeed's ALST tutorial loop, written against ``deepspeed`` names (deepshard's compat shim):
    rank r's DataLoader reads samples r, r + world, ...; the tutorial's token-weighted all_gather loss
    (``gather_loss``; torch's all_gather backward fails on gloo when sp < world, a torch bug) or
    ``deepshard.sp.sp_token_mean``. ``mode``: deepshard's ``sequence_parallel_mode`` (hybrid: Ulysses
    pairs); ``packed``: documents packed in each sample (position ids restarting)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    before = ALL_ATTENTION_FUNCTIONS[attn] if attn in ALL_ATTENTION_FUNCTIONS else None
    try:
        return _alst_loop(attn, sp_size, stage, seq_len, gather_loss, mode, packed)
    finally:  # the next script registers its own wrapper around the real attention
        if before is not None:
            ALL_ATTENTION_FUNCTIONS[attn] = before


def _alst_loop(attn: str, sp_size: int, stage: int, seq_len: int, gather_loss: bool, mode: str,
               packed: bool) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.nn.functional as dnn

    import deepshard.compat as compat

    compat.install()
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from deepspeed.runtime.utils import move_to_device
    from deepspeed.utils import groups

    model = tiny_llama(attn)
    extra = {} if mode == "ulysses" else {"sequence_parallel_mode": mode, "ulysses_size": 2 if mode == "hybrid" else None}
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=attn, sequence_parallel_size=sp_size,
        micro_batch_size=1, seq_length=seq_len, seq_length_is_variable=True, **extra)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}, "gradient_clipping": CLIP,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "sequence_parallel_size": sp_size}
    engine, *_ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters(), mpu=mpu)
    world, rank = dist.get_world_size(), dist.get_rank()
    ids = hf_samples(seq_len)[rank::world]
    data = [{"input_ids": x.unsqueeze(0), "position_ids": hf_positions(seq_len, packed),
             "labels": x.unsqueeze(0)} for x in ids]
    sp_group = groups._get_sequence_parallel_group()
    sp_world_size = groups._get_sequence_parallel_world_size()
    dl = UlyssesSPDataLoaderAdapter(torch.utils.data.DataLoader(data, batch_size=None), sp_rank=groups._get_sequence_parallel_rank(),
                                    sp_group=sp_group, sp_world_size=sp_world_size, device=engine.device)
    losses, norms = [], []
    for step, batch in zip(range(HF_STEPS), dl):
        batch = move_to_device(batch, engine.device)
        shift_labels = batch["shift_labels"]
        outputs = engine(**batch)
        loss = engine.module.loss_function(logits=outputs.logits, labels=None, shift_labels=shift_labels,
                                           vocab_size=engine.module.config.vocab_size)
        good_tokens = (shift_labels != -100).view(-1).sum()
        if gather_loss:
            losses_per_rank = dnn.all_gather(loss, group=sp_group)
            good_per_rank = dnn.all_gather(good_tokens, group=sp_group)
            total = sum(losses_per_rank[r] * good_per_rank[r] for r in range(sp_world_size))
            loss = total / max(sum(good_per_rank), 1)
        else:
            from deepshard.sp import sp_token_mean

            loss = sp_token_mean(loss * good_tokens, good_tokens, sp_group)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        norms.append(engine.get_global_grad_norm())
    weights = _full_weights(engine)
    engine.destroy()
    compat.uninstall()
    return {"losses": losses, "norms": norms, "weights": weights, "dp": engine.topology.coord.dp}


def hf_world(rank: int, world: int) -> dict[str, Any]:
    """sp4 with sdpa at ZeRO 3 (6 heads over 4 ranks, 14 tokens: both uneven); dp2 x sp2 with eager at ZeRO 1
    (13 tokens, packed documents); ring sp4 (sdpa, packed, 14 tokens) at ZeRO 1; hybrid 2x2 (sdpa, 15
    tokens, packed) at ZeRO 2."""
    return {"sdpa_sp4_z3": alst_script("sdpa", 4, 3, 14, gather_loss=True),
            "eager_dp2sp2_z1_packed": alst_script("eager", 2, 1, 13, gather_loss=False, packed=True),
            "ring_sp4_z1_packed": alst_script("sdpa", 4, 1, 14, gather_loss=True, mode="ring", packed=True),
            "hybrid_sp4_z2_packed": alst_script("sdpa", 4, 2, 15, gather_loss=True, mode="hybrid", packed=True)}


def hf_reference(attn: str, seq_len: int, steps: list[list[int]], packed: bool = False) -> dict[str, Any]:
    """One process, the same model and samples (packed: transformers itself reads the documents from the
    restarting position ids): each step's loss is the mean of its samples' token means."""
    model = tiny_llama(attn)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    samples = hf_samples(seq_len)
    positions = hf_positions(seq_len, packed)
    losses, norms = [], []
    for chosen in steps:
        loss = sum(model(input_ids=samples[i:i + 1], position_ids=positions, labels=samples[i:i + 1]).loss
                   for i in chosen) / len(chosen)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}
