"""Launcher e2e helper: rank 1 raises after start-up; rank 0 starts a helper process and sleeps."""
import os
import subprocess
import sys
import time

rank = int(os.environ["RANK"])
if rank == 1:
    time.sleep(1.0)
    print(f"rank 1 failing at {time.time():.3f}", flush=True)
    raise RuntimeError("boom from rank 1: deliberate failure")
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(f"rank 0 pid={os.getpid()} helper_pid={helper.pid}", flush=True)
time.sleep(60)
