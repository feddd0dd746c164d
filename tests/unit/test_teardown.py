"""Exit-time teardown (utils/teardown.py): one handler however often it is registered, and the settling
step really lets a thread that waits for the GIL run before the interpreter finalizes."""
from __future__ import annotations

import subprocess
import sys
import textwrap

# Each case registers the handlers in some order and prints how often the exit settled (time.sleep is
# counted, not slept) and whether it destroyed a group (none exists here: the destroy step is skipped).
REGISTRATIONS = """
import atexit, sys
from deepshard.utils import teardown
sleeps = []
teardown.time = type("T", (), {"sleep": staticmethod(sleeps.append)})
atexit.register(lambda: print(len(sleeps)))
for name in sys.argv[1].split(","):
    getattr(teardown, name)()
"""
# A daemon thread that wakes 50 ms after the script ends stands for the gloo worker that must take the
# GIL to free its last tensor; the check registered first runs last, after deepshard's handler.
STARVED_WORKER = """
import atexit, sys, threading, time
ran = []
atexit.register(lambda: print("worker ran" if ran else "worker starved"))
if sys.argv[1] == "settle":
    from deepshard.utils import teardown
    teardown.destroy_process_group_at_exit()
threading.Thread(target=lambda: (time.sleep(0.05), ran.append(1)), daemon=True).start()
"""


def _python(code: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_exit_settles_once_however_the_handlers_were_registered() -> None:
    settle, destroy = "settle_backend_threads_at_exit", "destroy_process_group_at_exit"
    for order in ([settle, settle], [destroy, destroy], [settle, destroy, settle], [destroy, settle]):
        assert _python(REGISTRATIONS, ",".join(order)) == "1", order


def test_settling_lets_a_thread_waiting_for_the_gil_finish_before_finalization() -> None:
    """Without the handler the worker is starved ("none": checked by hand, not asserted here, because a
    loaded machine may stall the main thread past the worker's 50 ms and let it run anyway)."""
    assert _python(STARVED_WORKER, "settle") == "worker ran"
