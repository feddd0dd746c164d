"""DeepSpeed through the real Hugging Face Accelerate and Trainer, on deepshard, 2 CPU processes:

* Accelerate's recipe (``from accelerate import Accelerator, DeepSpeedPlugin``, untouched) started by
  ``deepshard launch --config_file`` on a ZeRO-2 ``use_cpu`` YAML, and the same script in the one-import
  form (``from deepshard.accelerate import ...``) under the plain ``deepshard`` launcher, and ZeRO-3 with
  the optimizer offloaded (flags over the file; Accelerate swaps in ``DeepSpeedCPUAdam``): Accelerate sees
  the 2-process world, the data is sharded, the losses equal single-process PyTorch on the same global
  batch, ``get_state_dict`` gives its weights, ``save_state`` / ``load_state`` resume exactly,
  ``gather_for_metrics`` drops the padding.
* The ``transformers`` Trainer with ``deepspeed=`` an ``"auto"`` config at ZeRO-2 and ZeRO-3, fp32 and
  bf16, and with gradient accumulation: losses equal a plain single-process Trainer on the same global batch, ``save_model`` -> ``from_pretrained`` gives its
  logits, ``resume_from_checkpoint`` continues exactly.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.e2e.test_launcher import ROOT, SCRIPTS, _clean_env, _deepshard, _free_port

pytest.importorskip("accelerate", reason="needs Hugging Face Accelerate: pip install '.[hf]' in a deepshard checkout")

YAML = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  gradient_accumulation_steps: 1
  gradient_clipping: 1.0
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: false
  zero_stage: 2
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: true
"""


def _env(**extra: str) -> dict[str, str]:
    env = _clean_env(DEEPSHARD_REPLACE_DEEPSPEED="1", OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


def _finish(proc: subprocess.Popen, what: str, timeout: float = 400) -> None:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{what} failed:\n{out[-6000:]}"


def _recipe_reference(steps: int) -> tuple[list[float], torch.Tensor, dict[str, torch.Tensor]]:
    """Single-process PyTorch on the global batch (8 = 4 per rank x 2), the clipping the YAML asks for."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("accelerate_recipe", SCRIPTS / "accelerate_recipe.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)  # type: ignore[union-attr]
    torch.manual_seed(0)
    model = recipe.TestNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x_all, y_all = recipe.data(64, seed=1).tensors
    losses = []
    for k in range(steps):
        x, y = x_all[8 * k:8 * k + 8], y_all[8 * k:8 * k + 8]
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, x_all, model.state_dict()


def _check_recipe(out: Path, reference: list[float], x_all: torch.Tensor, weights: dict[str, torch.Tensor],
                  stage: int = 2, optimizer: str = "AdamW") -> None:
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r, rec in enumerate(ranks):
        assert (rec["num_processes"], rec["process_index"], rec["is_main"]) == (2, r, r == 0), rec
        assert rec["distributed_type"] == "DistributedType.DEEPSPEED" and rec["zero_stage"] == stage
        # accelerate wraps engine.optimizer: DeepSpeed's ZeRO optimizer class, the torch optimizer inside it
        assert rec["optimizer_class"] == ("DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer")
        assert rec["torch_optimizer_class"] == optimizer
        assert rec["deepspeed_module"] == "deepspeed"
        assert torch.equal(torch.tensor(rec["first_x"]), x_all[4 * r:4 * r + 4])  # batch r of 4: sharded
        assert rec["resumed"] == rec["after"]  # load_state restored model and optimizer exactly
        assert rec["eval_rows"] == 10  # 10 samples, padded to 12 over 2 ranks, duplicates dropped
    got = {k: torch.tensor(v) for k, v in ranks[0]["weights"].items()}
    assert got.keys() == weights.keys()
    for k, v in weights.items():  # get_state_dict: the full trained weights, as single-process PyTorch's
        assert torch.allclose(got[k], v, atol=1e-6), k
    mean = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])]
    assert max(abs(m - ref) for m, ref in zip(mean, reference)) < 1e-5, (mean, reference)


def test_accelerate_recipe_under_deepshard_launch_and_one_import(tmp_path: Path) -> None:
    config = tmp_path / "default_config.yaml"
    config.write_text(YAML)
    launched, one_import, offload = tmp_path / "launched", tmp_path / "one_import", tmp_path / "offload"
    for out in (launched, one_import, offload):
        out.mkdir()
    script = (SCRIPTS / "accelerate_recipe.py").read_text()
    changed = script.replace("from accelerate import Accelerator, DeepSpeedPlugin",
                             "from deepshard.accelerate import Accelerator, DeepSpeedPlugin")
    assert changed.count("deepshard.accelerate") == 1
    (tmp_path / "one_import_recipe.py").write_text(changed)
    procs = [subprocess.Popen([*_deepshard(), "launch", "--config_file", str(config), "--main_process_port",
                               str(_free_port()), str(SCRIPTS / "accelerate_recipe.py")], cwd=ROOT,
                              env=_env(RECIPE_OUT=str(launched)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)]
    # the one-import form under the plain launcher, with the variables Accelerate's launcher would set
    from deepshard.accelerate import launch_config as ac

    from_yaml = ac.plan(ac.read_config_file(config), {}, "x.py", []).env
    procs.append(subprocess.Popen([*_deepshard(), "--num_gpus", "2", "--master_port", str(_free_port()),
                                   "--no_local_rank", str(tmp_path / "one_import_recipe.py")], cwd=ROOT,
                                  env=_env(RECIPE_OUT=str(one_import), **from_yaml), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True))
    # flags over the file: ZeRO-3 with the optimizer offloaded (Accelerate swaps AdamW for DeepSpeedCPUAdam)
    procs.append(subprocess.Popen([*_deepshard(), "launch", "--config_file", str(config), "--zero_stage", "3",
                                   "--offload_optimizer_device", "cpu", "--zero3_save_16bit_model", "true",
                                   "--main_process_port", "0", str(SCRIPTS / "accelerate_recipe.py")], cwd=ROOT,
                                  env=_env(RECIPE_OUT=str(offload)), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True))
    reference, x_all, weights = _recipe_reference(steps=6)
    for proc, what in zip(procs, ("deepshard launch --config_file", "the one-import form", "ZeRO-3 + offload")):
        _finish(proc, what)
    _check_recipe(launched, reference, x_all, weights)
    _check_recipe(one_import, reference, x_all, weights)
    _check_recipe(offload, reference, x_all, weights, stage=3, optimizer="DeepSpeedCPUAdam")


def test_unchanged_accelerate_launch_with_the_standin(tmp_path: Path) -> None:
    """``accelerate launch --config_file cfg.yaml script.py``, Accelerate's own launcher, unchanged, after the
    one step ``python -m deepshard.compat.standin on`` (here into a temporary site directory that a
    ``sitecustomize`` adds, so the test environment is not changed): Accelerate finds a DeepSpeed, starts
    its ranks through torchrun, and their ``import deepspeed`` is deepshard. On a CPU the YAML says
    ``use_cpu: false`` (``true`` makes Accelerate start a single process without DeepSpeed)."""
    from deepshard.compat import standin

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(site)!r})\n")
    standin.turn_on(site)
    config, out = tmp_path / "cfg.yaml", tmp_path / "out"
    config.write_text(YAML.replace("use_cpu: true", "use_cpu: false"))
    out.mkdir()
    env = _env(RECIPE_OUT=str(out))
    env.pop("DEEPSHARD_REPLACE_DEEPSPEED")
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    accelerate = Path(sys.executable).with_name("accelerate")
    proc = subprocess.Popen([str(accelerate), "launch", "--config_file", str(config), "--main_process_port",
                             str(_free_port()), str(SCRIPTS / "accelerate_recipe.py")], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reference, x_all, weights = _recipe_reference(steps=6)
    _finish(proc, "accelerate launch with the stand-in")
    _check_recipe(out, reference, x_all, weights)


def test_hf_trainer_zero2_zero3_fp32_bf16_match_a_plain_trainer(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="needs transformers: pip install '.[hf]' in a deepshard checkout")
    from transformers import LlamaForCausalLM

    cases = ["z2-fp32", "z3-fp32", "z2-bf16", "z3-bf16", "z3-fp32-ga2"]  # ga2: 1 sample x 2 micro-steps x 2 ranks
    script = str(SCRIPTS / "hf_trainer.py")
    ds = subprocess.Popen([*_deepshard(), "launch", "--num_processes", "2", "--use_cpu", "--main_process_port",
                           str(_free_port()), script, str(tmp_path / "ds"), "ds", *cases], cwd=ROOT, env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    plain = subprocess.Popen([sys.executable, script, str(tmp_path / "plain"), "plain", "z0-fp32", "z0-bf16"],
                             cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _finish(plain, "the plain single-process Trainer")
    _finish(ds, "the Trainer on deepshard")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(7))
    for case in cases:
        precision = case.split("-")[1]  # every case has the global batch of 4: one plain reference per precision
        ref = json.loads((tmp_path / "plain" / f"z0-{precision}" / "losses-rank0.json").read_text())
        # fp32: the same arithmetic; bf16: deepshard computes in bf16 weights (fp32 masters) where the plain
        # Trainer autocasts fp32 weights, so the two round differently
        tol = 1e-5 if precision == "fp32" else 2e-3
        for r in range(2):
            got = json.loads((tmp_path / "ds" / case / f"losses-rank{r}.json").read_text())
            assert got["world"] == 2 and len(got["losses"]) == len(ref["losses"]) == 6
            assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) < tol, (case, got, ref)
            assert got["resumed"] == got["losses"][3:], (case, got)  # resume continues exactly
        with torch.no_grad():
            theirs = LlamaForCausalLM.from_pretrained(tmp_path / "plain" / f"z0-{precision}" / "final").float()(ids)
            ours = LlamaForCausalLM.from_pretrained(tmp_path / "ds" / case / "final").float()(ids)
        assert torch.allclose(ours.logits, theirs.logits, atol=1e-4 if precision == "fp32" else 5e-2), case


def test_hf_trainer_script_under_the_deepspeed_style_launcher(tmp_path: Path) -> None:
    """``deepshard --num_gpus 2 train.py --deepspeed ds.json`` (Hugging Face's documented ``deepspeed`` line)
    runs a Trainer script that never imports deepshard: the ranks' ``import deepspeed`` (Accelerate's, the
    Trainer's) is deepshard, as under ``deepshard launch``."""
    pytest.importorskip("transformers", reason="needs transformers: pip install '.[hf]' in a deepshard checkout")
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                                                  "gradient_accumulation_steps": "auto",
                                                  "zero_optimization": {"stage": 2}}))
    done = subprocess.run([*_deepshard(), "--num_gpus", "2", "--master_port", "0",
                           str(SCRIPTS / "hf_trainer_deepspeed_flag.py"), "--deepspeed", str(tmp_path / "ds.json"),
                           "--output_dir", str(tmp_path / "out"), "--max_steps", "3", "--per_device_train_batch_size",
                           "2", "--report_to", "none", "--save_strategy", "no"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=400)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    results = [line for line in out.splitlines() if line.startswith("RESULT rank")]
    assert len(results) == 2 and all("src/deepshard/__init__.py" in line for line in results), out[-3000:]


def test_accelerates_own_test_scripts_under_deepshard() -> None:
    """Accelerate's bundled scripts whose checks apply under DeepSpeed: collective ops (``test_ops``) and
    ``test_script`` (process control, RNG sync, dataloader sharding and seedable samplers; it stops
    before its training checks under DeepSpeed by its own design). Both run as modules (``-m``).
    Alongside: a ZeRO-3 model built inside ``main_process_first`` fails with the reason, not a hang."""
    procs = {name: subprocess.Popen([*_deepshard(), "launch", "--num_processes", "2", "--use_cpu",
                                     "--main_process_port", str(_free_port()), "-m",
                                     f"accelerate.test_utils.scripts.{name}"], cwd=ROOT, env=_env(),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name in ("test_ops", "test_script")}
    hang = None
    if importlib.util.find_spec("transformers") is not None:  # accelerate #3709, which hangs under DeepSpeed
        hang = subprocess.Popen([*_deepshard(), "launch", "--num_processes", "2", "--use_cpu", "--main_process_port",
                                 "0", str(SCRIPTS / "main_process_first_zero3.py")], cwd=ROOT, env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outputs = {}
    for name, proc in procs.items():
        outputs[name], _ = proc.communicate(timeout=400)
        assert proc.returncode == 0, f"{name} failed:\n{outputs[name][-6000:]}"
    if hang is not None:
        out, _ = hang.communicate(timeout=300)  # a hang would time out here
        assert hang.returncode != 0 and "built inside" not in out, out[-3000:]
        assert "inside accelerate's main_process_first(), where the ranks run one after another" in out, out[-3000:]
    assert "testing sending tensors across devices" in outputs["test_ops"]
    assert "Shuffled central dataloader passing." in outputs["test_script"]
    assert "All rng are properly synched." in outputs["test_script"]
