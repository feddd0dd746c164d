"""The one timeout setting: DEEPSHARD_TIMEOUT (minutes) read for the watchdog, the source named in
messages, the retired DEEPSHARD_WATCHDOG_TIMEOUT refused, gloo's own timeout reported as it fired."""
from __future__ import annotations

import datetime
from typing import Any

import pytest

from deepshard.comm.watchdog import CollectiveTimeout, Watchdog, WaitLimit, wait_limit
from deepshard.distributed import default_timeout


class _Comm:
    rank, size, peers, group, progress, backend = 0, 2, [0, 1], None, None, "gloo"


class _Work:
    def __init__(self, error: str | None = None) -> None:
        self.error = error
        self.waited: Any = None

    def wait(self, timeout: Any = None) -> bool:
        self.waited = timeout
        if self.error:
            raise RuntimeError(self.error)
        return False


def test_deepshard_timeout_sets_the_watchdog_and_the_process_group_alike() -> None:
    limit = wait_limit(environ={"DEEPSHARD_TIMEOUT": "0.05"})
    assert limit.seconds == pytest.approx(3.0) and limit.source == "DEEPSHARD_TIMEOUT=0.05 minutes"
    assert default_timeout({"DEEPSHARD_TIMEOUT": "0.05"}) == datetime.timedelta(seconds=3)
    assert wait_limit(environ={"DEEPSPEED_TIMEOUT": "2"}).seconds == 120.0


def test_the_retired_watchdog_variable_is_refused_with_the_replacement() -> None:
    with pytest.raises(ValueError, match="DEEPSHARD_WATCHDOG_TIMEOUT is no longer read: DEEPSHARD_TIMEOUT"):
        wait_limit(environ={"DEEPSHARD_WATCHDOG_TIMEOUT": "300"})
    with pytest.raises(ValueError, match="must be a positive number of minutes"):
        wait_limit(environ={"DEEPSHARD_TIMEOUT": "0"})


def test_the_message_states_the_timeout_that_fired() -> None:
    dog = Watchdog(_Comm(), WaitLimit(3.0, "DEEPSHARD_TIMEOUT=0.05 minutes"))
    dog._store = None
    work = _Work()
    with pytest.raises(CollectiveTimeout, match=r"did not complete within 3s \(DEEPSHARD_TIMEOUT=0.05 minutes\)"):
        dog.wait(work, "all_reduce of 4 float32 elements over 2 ranks")
    assert work.waited == datetime.timedelta(seconds=3)
    gloo = _Work("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 60000ms for recv operation")
    with pytest.raises(CollectiveTimeout, match=r"within 60s \(the process group's timeout"):
        dog.wait(gloo, "barrier")


class _NcclComm(_Comm):
    backend = "nccl"


def test_nccl_waits_do_not_hold_the_host() -> None:
    """A timed wait on NCCL blocks the host until the GPU finishes (torch's WorkNCCL polls); the watchdog
    must make the plain, stream-ordered wait there, for collectives and transfers alike."""
    dog = Watchdog(_NcclComm(), WaitLimit(3.0, "DEEPSHARD_TIMEOUT=0.05 minutes"))
    dog._store = None
    for transfer in (False, True):
        work = _Work()
        work.waited = "not waited"
        dog.wait(work, "all_gather of 8 bfloat16 elements over 2 ranks", transfer=transfer)
        assert work.waited is None
    assert dog.sequence == 1
    gloo = Watchdog(_Comm(), WaitLimit(3.0, "x"))
    gloo._store = None
    work = _Work()
    with pytest.raises(CollectiveTimeout):
        gloo.wait(work, "barrier")
    assert work.waited == datetime.timedelta(seconds=3)  # gloo keeps the timed wait and its diagnosis
