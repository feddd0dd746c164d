"""Launcher e2e helper: rank 1 exits with code 3 on the first attempt (DEEPSHARD_RESTART_COUNT 0)."""
import os

rank, attempt = os.environ["RANK"], os.environ["DEEPSHARD_RESTART_COUNT"]
print(f"rank {rank} attempt {attempt}", flush=True)
if rank == "1" and attempt == "0":
    os._exit(3)
