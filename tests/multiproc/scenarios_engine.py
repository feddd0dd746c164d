"""What each rank runs for the engine-API tests (importable by spawned processes)."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import deepshard
from deepshard.checkpoint.io import CheckpointError
from tests.multiproc.models import make_batches, make_model, micro_slice, optimizer_config, sgd_config
from tests.multiproc.scenarios_stage0 import full_weights, run_steps


def _config(micro: int = 2, gas: int = 1, **extra: Any) -> dict[str, Any]:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
           "optimizer": optimizer_config(), "gradient_clipping": 0.0, "zero_optimization": {"stage": 0}}
    cfg.update(extra)
    return cfg


def accounting(rank: int, world: int) -> dict[str, Any]:
    """memory_report and comms volume after one step, fp32 and bf16."""
    out: dict[str, Any] = {}
    for dtype in ("fp32", "bf16"):
        extra = {"bf16": {"enabled": True}} if dtype == "bf16" else {}
        engine, *_ = deepshard.initialize(model=make_model(), config=_config(gas=2, **extra))
        engine.comms_logger.reset()
        batch = make_batches(1, 2 * 2 * world)[0]
        run_steps(engine, [batch], 2, 2, rank, world)
        model = engine.module
        out[dtype] = {
            "report": engine.memory_report(),
            "psi_trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "psi_total": sum(p.numel() for p in model.parameters()),
            "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
            "comms": engine.comms_logger.summary(),
            "volume": engine.comms_logger.total_volume_elements(),
            "frozen_in_state": any(engine.optimizer.state.get(p) for p in model.frozen.parameters()),
            "frozen_grad": [p.grad for p in model.frozen.parameters()],
        }
    return out


def no_sync_and_boundary(rank: int, world: int) -> dict[str, Any]:
    """no_sync() and set_gradient_accumulation_boundary(): local accumulation then one reduction."""
    batches = make_batches(2, 4 * world, seed=9)
    results: dict[str, Any] = {}
    engine, *_ = deepshard.initialize(model=make_model(), config=_config(micro=2, gas=1, optimizer=sgd_config()))
    calls_inside = []
    for batch in batches:
        xa, ya = micro_slice(batch, 2, 0, rank, world)
        xb, yb = micro_slice(batch, 2, 1, rank, world)
        engine.comms_logger.reset()
        with engine.no_sync():
            engine.backward(engine(xa, ya))
        calls_inside.append(sum(s["calls"] for s in engine.comms_logger.summary().values()))  # any collective
        engine.backward(engine(xb, yb))
        engine.step()
    results["no_sync"] = full_weights(engine)
    results["calls_inside_first_no_sync"] = calls_inside
    try:
        with engine.no_sync():
            engine.step()
        results["step_in_no_sync"] = "no error"
    except RuntimeError as e:
        results["step_in_no_sync"] = str(e)

    engine2, *_ = deepshard.initialize(model=make_model(), config=_config(micro=2, gas=1, optimizer=sgd_config()))
    applied = []
    for batch in batches:
        xa, ya = micro_slice(batch, 2, 0, rank, world)
        xb, yb = micro_slice(batch, 2, 1, rank, world)
        engine2.set_gradient_accumulation_boundary(False)
        engine2.backward(engine2(xa, ya))
        engine2.step()
        applied.append(engine2.was_step_applied())
        engine2.set_gradient_accumulation_boundary(True)
        engine2.backward(engine2(xb, yb))
        engine2.step()
        applied.append(engine2.was_step_applied())
    results["boundary"] = full_weights(engine2)
    results["applied"] = applied
    return results


def _reductions(engine: Any) -> int:
    """Reducing collectives (reduce-scatter, all-reduce, reduce) since the comms logger's reset: the
    gradient reductions (ZeRO-3's parameter all-gathers are not counted)."""
    return sum(s["calls"] for op, s in engine.comms_logger.summary().items() if "reduce" in op)


def coalesced_reduction(rank: int, world: int) -> dict[str, Any]:
    """engine.coalesce_grad_reduction() at ZeRO 1-3 against the same two backward passes without it (the
    first not at the boundary): the weights after each step, and the reductions counted inside the block and
    up to its exit (over the whole window without it) (fp32, SGD: sensitive to the gradient's magnitude)."""
    batches = make_batches(2, 4 * world, seed=9)
    out: dict[str, Any] = {}
    for stage in (1, 2, 3):
        cfg = _config(micro=2, gas=1, optimizer=sgd_config(), zero_optimization={"stage": stage})
        for coalesce in (False, True):
            engine, *_ = deepshard.initialize(model=make_model(), config=cfg)
            counts: list[tuple[int, int]] = []
            for batch in batches:
                engine.comms_logger.reset()
                block = engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext()
                with block:
                    for m in range(2):
                        engine.set_gradient_accumulation_boundary(m == 1)
                        engine.backward(engine(*micro_slice(batch, 2, m, rank, world)))
                    inside = _reductions(engine)
                counts.append((inside, _reductions(engine)))
                engine.step()
            key = "coalesced" if coalesce else "plain"
            out[(stage, key)] = {"weights": full_weights(engine), "counts": counts}
            if coalesce:
                out[(stage, "refusals")] = _coalesce_refusals(engine)
            engine.destroy()
    return out


def _coalesce_refusals(engine: Any) -> list[str]:
    """What step() and no_sync() inside the block, and a nested block, raise (type: message)."""
    out = []
    for inner in (engine.step, engine.no_sync, engine.coalesce_grad_reduction):
        try:
            with engine.coalesce_grad_reduction():
                result = inner()
                if hasattr(result, "__enter__"):
                    with result:
                        pass
            out.append("no error")
        except (RuntimeError, AssertionError) as err:
            out.append(f"{type(err).__name__}: {err}")
    return out


def api_surface(rank: int, world: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # a user optimizer wins over the config's; a callable receives the parameters
    model = make_model()
    user_opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    engine, opt, loader, sched = deepshard.initialize(model=model, optimizer=user_opt, config=_config())
    out["user_opt_is_used"] = opt is user_opt and engine.optimizer is user_opt
    out["loader_sched_none"] = loader is None and sched is None
    batches = make_batches(3, 2 * world, seed=3)
    run_steps(engine, batches, 2, 1, rank, world)
    out["user_opt_weights"] = full_weights(engine)
    engine_c, opt_c, *_ = deepshard.initialize(
        model=make_model(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), config=_config())
    run_steps(engine_c, batches, 2, 1, rank, world)
    out["callable_opt_weights"] = full_weights(engine_c)
    out["callable_opt_type"] = type(opt_c).__name__
    # attributes fall through to the module; DeepSpeed's accessors
    out["getattr"] = engine.embed is engine.module.embed
    out["accessors"] = (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                        engine.gradient_accumulation_steps(), engine.zero_optimization_stage(),
                        engine.dp_world_size, engine.global_rank == rank, engine.global_steps,
                        engine.global_samples, engine.micro_steps, str(engine.device))
    # the dataloader gives each rank distinct samples
    data = torch.utils.data.TensorDataset(torch.arange(8 * world, dtype=torch.float32).unsqueeze(1))
    _, _, loader, _ = deepshard.initialize(model=make_model(), training_data=data, config=_config())
    seen = torch.cat([b[0].reshape(-1) for b in loader])
    gathered = [torch.zeros_like(seen) for _ in range(world)]
    dist.all_gather(gathered, seen)
    out["loader_disjoint_cover"] = sorted(torch.cat(gathered).tolist()) == list(map(float, range(8 * world)))
    # nothing to load
    out["empty_load"] = engine.load_checkpoint(str(Path(tmp) / "nothing"))
    # save_16bit_model, load_module_only, damaged checkpoints
    eng_b, *_ = deepshard.initialize(model=make_model(), config=_config(bf16={"enabled": True}))
    run_steps(eng_b, batches, 2, 1, rank, world)
    eng_b.save_16bit_model(tmp, "model.safetensors")
    eng_b.save_checkpoint(tmp, tag="t1")
    from safetensors.torch import load_file

    saved16 = load_file(str(Path(tmp) / "model.safetensors"))
    out["16bit_exact"] = all(torch.equal(saved16[k], v.cpu()) for k, v in eng_b.module.state_dict().items())
    out["16bit_dtype"] = str(saved16["embed.weight"].dtype)
    fresh, *_ = deepshard.initialize(model=make_model(), config=_config(bf16={"enabled": True}))
    path, _ = fresh.load_checkpoint(tmp, tag="t1", load_module_only=True)
    out["module_only"] = (all(torch.equal(full_weights(fresh)[k], v) for k, v in full_weights(eng_b).items()),
                          fresh.global_steps)
    out["corrupt"] = _load_after_damage(fresh, rank, Path(tmp) / "t1" / "zero_rank0.safetensors", _flip_a_byte)
    out["truncated"] = _load_after_damage(fresh, rank, Path(tmp) / "t1" / "module_extra.safetensors",
                                          lambda data: data[:100])
    return out


def _flip_a_byte(data: bytes) -> bytes:
    damaged = bytearray(data)
    damaged[-5] ^= 0xFF
    return bytes(damaged)


def _load_after_damage(engine: Any, rank: int, victim: Path, damage: Any) -> str:
    """Rank 0 rewrites ``victim`` through ``damage``; every rank then loads tag t1: the error, or "no error".
    The file is restored afterwards, so each damage is seen alone."""
    dist.barrier()
    original = victim.read_bytes()
    if rank == 0:
        victim.write_bytes(damage(original))
    dist.barrier()
    try:
        engine.load_checkpoint(str(victim.parent.parent), tag="t1")
        return "no error"
    except CheckpointError as e:
        return str(e)
    finally:
        dist.barrier()
        if rank == 0:
            victim.write_bytes(original)
        dist.barrier()


def two_engines_interleaved(rank: int, world: int) -> dict[str, Any]:
    """Two engines in one process, stepped alternately, each equal to its own single-engine run."""
    batches = make_batches(4, 2 * world, seed=4)
    a, *_ = deepshard.initialize(model=make_model(), config=_config())
    b, *_ = deepshard.initialize(model=make_model(), config=_config(optimizer=sgd_config(),
                                                                    bf16={"enabled": True}))
    for batch in batches:
        run_steps(a, [batch], 2, 1, rank, world)
        run_steps(b, [batch], 2, 1, rank, world)
    solo_a, *_ = deepshard.initialize(model=make_model(), config=_config())
    run_steps(solo_a, batches, 2, 1, rank, world)
    solo_b, *_ = deepshard.initialize(model=make_model(), config=_config(optimizer=sgd_config(),
                                                                         bf16={"enabled": True}))
    run_steps(solo_b, batches, 2, 1, rank, world)
    same = lambda x, y: all(torch.equal(full_weights(x)[k], v) for k, v in full_weights(y).items())  # noqa: E731
    return {"a": same(a, solo_a), "b": same(b, solo_b)}


def predivide_and_comm_dtype(rank: int, world: int) -> dict[str, Any]:
    batches = make_batches(4, 4 * world, seed=11)
    out = {}
    for name, extra in {"predivide": {"gradient_predivide_factor": 2.0},
                        "prescale": {"prescale_gradients": True},
                        "comm_fp16": {"communication_data_type": "fp16"}}.items():
        engine, *_ = deepshard.initialize(model=make_model(), config=_config(optimizer=sgd_config(), **extra))
        losses = run_steps(engine, batches, 4, 1, rank, world)
        out[name] = (losses, full_weights(engine))
    return out


def engine_contract(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Every scenario of tests/multiproc/test_engine_api.py in one world (a spawn each cost more than the
    scenarios): each builds its own engines; accounting runs first, before any other engine's traffic."""
    return {"accounting": accounting(rank, world), "no_sync": no_sync_and_boundary(rank, world),
            "coalesce": coalesced_reduction(rank, world),
            "api": api_surface(rank, world, tmp), "two_engines": two_engines_interleaved(rank, world),
            "predivide": predivide_and_comm_dtype(rank, world)}
