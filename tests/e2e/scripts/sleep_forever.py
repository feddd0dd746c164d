"""Launcher e2e helper: each rank prints its pid and sleeps (for signal-forwarding tests)."""
import os
import time

print(f"rank {os.environ['RANK']} pid={os.getpid()} sleeping", flush=True)
time.sleep(60)
