"""Started by Python in every process of a DeepSpeed unit-test run on deepshard's side (the pytest process
and the workers DeepSpeed's ``DistributedTest`` spawns through a forkserver, which no pytest plugin
reaches): with ``DEEPSHARD_DS_UNIT_SHIM=1`` it installs ``deepshard.compat`` before anything imports
``deepspeed``, so the unmodified tests import deepshard."""
import os

if os.environ.get("DEEPSHARD_DS_UNIT_SHIM") == "1":
    import deepshard.compat

    deepshard.compat.install(replace_installed=True)

_PRELOAD = [name for name in os.environ.get("DS_UNIT_FORKSERVER_PRELOAD", "").split(",") if name]
if _PRELOAD:
    # DeepSpeed's DistributedTest starts every test's workers from a forkserver; with torch imported once in
    # the forkserver each worker is a fork instead of a fresh interpreter importing it (the same for both
    # sides; the tests are not changed). Only torch: a forkserver that has imported deepspeed (whose import
    # starts threads) forks workers that deadlock in their first parallel kernel.
    import multiprocessing

    multiprocessing.set_forkserver_preload(_PRELOAD)
