"""The node agents' coordination protocol (on an in-memory store, and once on a real TCPStore), the
per-node rank plan, and the agent's stop decisions; no training processes."""
from __future__ import annotations

import json
import socket
import sys
import threading

import pytest
import torch.distributed as dist

from deepshard.launcher.coordination import (
    ChannelLost,
    JobChannel,
    JobConfigMismatch,
    JobFailure,
    open_store,
)
from deepshard.launcher.agent import AgentJob, entry
from deepshard.launcher.local import TORCH_SETS, LocalLaunch
from deepshard.launcher.node import NodeJob, node_agent_job
from deepshard.launcher.options import LaunchError
from deepshard.launcher.rendezvous import NodeRendezvous, format_job_failure

HOSTS = ["node-a", "node-b", "node-c"]
FAIL = JobFailure("rank", 1, "node-b", "rank 3 (local rank 1, pid 77)", "exited with code 3", 3, rank=3,
                  tail="line 1\nboom")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _channels(num_nodes: int = 3, clock: Clock | None = None) -> list[JobChannel]:
    store = dist.HashStore()
    return [JobChannel(store, n, num_nodes, HOSTS[:num_nodes], heartbeat_timeout_s=10.0,
                       clock=clock or Clock()) for n in range(num_nodes)]


def test_failure_record_round_trip_and_headline() -> None:
    assert JobFailure.from_json(FAIL.to_json()) == FAIL
    assert FAIL.headline() == "rank 3 (local rank 1, pid 77) on host node-b (node 1) exited with code 3"
    full = format_job_failure(FAIL, full=True)
    assert full.splitlines() == ["deepshard: rank 3 (local rank 1, pid 77) on host node-b (node 1) exited with code 3",
                                 "----- last output of rank 3 (host node-b) -----", "line 1", "boom",
                                 "----- end of rank 3 output -----"]
    assert format_job_failure(FAIL, full=False) == full.splitlines()[0]


def test_config_must_match_node_0() -> None:
    node0, node1, _ = _channels()
    node0.check_config('{"world": 1}')
    node1.check_config('{"world": 1}')
    with pytest.raises(JobConfigMismatch, match="node 1's launch does not match node 0's.*only --node_rank differs"):
        node1.check_config('{"world": 2}')


def test_join_waits_for_every_node_and_names_the_missing_ones() -> None:
    node0, node1, node2 = _channels()
    others = [threading.Thread(target=ch.join, args=(0, 5.0, 0.01)) for ch in (node1, node2)]
    for t in others:
        t.start()
    node0.join(0, 5.0, poll_s=0.01)
    for t in others:
        t.join(5.0)
    assert not any(t.is_alive() for t in others)
    clock = Clock()
    lonely = _channels(clock=clock)[0]

    def tick(_: float) -> None:
        clock.now += 1.0

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("deepshard.launcher.coordination.time.sleep", tick)
        with pytest.raises(TimeoutError, match="attempt 0: node 1 \\(node-b\\), node 2 \\(node-c\\) did not "
                                               "join within 3 s.*DEEPSHARD_JOIN_TIMEOUT"):
            lonely.join(0, 3.0)
    assert clock.now == 3.0


def test_first_failure_wins_and_rounds_are_separate() -> None:
    node0, node1, node2 = _channels()
    assert node0.failure(0) is None
    assert node1.publish_failure(0, FAIL) == FAIL
    later = JobFailure("rank", 2, "node-c", "rank 5", "exited with code 1", 1, rank=5)
    assert node2.publish_failure(0, later) == FAIL  # node 1 was first
    assert node0.failure(0) == FAIL and node0.failure(1) is None
    assert node0.abort() is None
    stop = JobFailure("abort", 0, "node-a", "the node agent", "received SIGINT", 130, restartable=False)
    assert node0.publish_abort(stop) == stop and node2.abort() == stop


def test_finished_counts_every_node() -> None:
    node0, node1, node2 = _channels()
    node0.mark_finished(0)
    node1.mark_finished(0)
    assert not node2.all_finished(0)
    node2.mark_finished(0)
    assert node0.all_finished(0) and not node0.all_finished(1)


def test_lost_nodes_by_heartbeat_counter_not_clocks() -> None:
    clock = Clock()
    node0, node1, node2 = _channels(clock=clock)
    node1.beat()
    node2.beat()
    assert node0.lost_nodes() == []
    clock.now = 9.0
    node1.beat()
    assert node0.lost_nodes() == []
    clock.now = 10.5  # node 2 silent for 10.5 s, node 1 for 1.5 s
    assert node0.lost_nodes() == [2]
    node2.beat()
    assert node0.lost_nodes() == []
    late = _channels(clock=clock)[0]  # nodes that never beat have not started yet: not lost
    late.lost_nodes()
    clock.now = 100.0
    assert late.lost_nodes() == []


def test_node_0_stops_waiting_for_a_node_that_went_silent() -> None:
    clock = Clock()
    node0, node1, _ = _channels(clock=clock)
    node1.beat()  # node 1 started, then died before joining; node 2 never came

    def tick(_: float) -> None:
        clock.now += 1.0

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("deepshard.launcher.coordination.time.sleep", tick)
        with pytest.raises(ChannelLost, match="node agent on host node-b \\(node 1\\) sent no heartbeat for 10 s"):
            node0.join(0, 300.0)
    assert 10 < clock.now < 13
    abort = node1.abort()
    assert abort is not None and (abort.kind, abort.node) == ("lost", 1)


def test_wait_exited_skips_lost_nodes() -> None:
    node0, node1, node2 = _channels()
    node1.mark_exited()
    assert node0.wait_exited(0.0, skip=[2]) == []
    assert node0.wait_exited(0.0) == [2]


def test_real_tcp_store_host_client_and_loss() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    host = open_store("127.0.0.1", port, True, connect_timeout_s=5)
    client = JobChannel(open_store("127.0.0.1", port, False, connect_timeout_s=5), 1, 2, HOSTS[:2])
    server_side = JobChannel(host, 0, 2, HOSTS[:2])
    client.publish_failure(0, FAIL)
    assert server_side.failure(0) == FAIL
    with pytest.raises(ChannelLost, match="node 0 cannot serve the coordination store on port"):
        open_store("127.0.0.1", port, True, connect_timeout_s=1)  # the port is taken
    del server_side, host
    with pytest.raises(ChannelLost):
        client.failure(0)
    with pytest.raises(ChannelLost, match="cannot reach node 0's coordination store at 127.0.0.1:.*within 1 s"):
        open_store("127.0.0.1", port, False, connect_timeout_s=1)


# --------------------------------------------------------------------------------- the node agent


def _job(node_rank: int = 1, **kw: object) -> NodeJob:
    launch = LocalLaunch(user_script="t.py", user_args=["--x"], master_addr="10.0.0.1", master_port=4000,
                         bind_cores=bool(kw.pop("bind", False)))
    return NodeJob({"node-a": [0, 1], "node-b": [0, 2], "node-c": [0]}, node_rank, launch, **kw)  # type: ignore[arg-type]


def test_node_job_hosts_and_validation() -> None:
    job = _job(1)
    assert (job.host, job.hosts) == ("node-b", HOSTS)
    with pytest.raises(LaunchError, match="--node_rank 3 is out of range.*0..2"):
        _job(3)
    with pytest.raises(LaunchError, match="--max_restarts -1"):
        _job(0, max_restarts=-1)
    assert _job(0).fingerprint() == _job(2).fingerprint() != _job(0, max_restarts=1).fingerprint()


def test_node_agent_job_hands_torch_one_command_and_the_variables_it_does_not_set() -> None:
    job = _job(1, bind=True, max_restarts=2)
    ajob = node_agent_job(job, {"KEEP": "1", "FROM_ENV_FILE": "x", "RANK": "9"}, [0, 1, 2, 3],
                          launcher_env={"KEEP": "1"}, python="py")
    assert ajob.argv == ["py", "-u", "t.py", "--local_rank=${local_rank}", "--x"]  # torch's macro
    assert ajob.nproc == 2 and ajob.max_restarts == 2 and ajob.cores == [(0, 1), (2, 3)]
    # the launcher's own variables reach the ranks through the agent; torch sets RANK and its kin
    assert ajob.rank_env == {"FROM_ENV_FILE": "x", "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}
    assert not TORCH_SETS & set(ajob.rank_env)


def test_rank_shim_binds_sets_and_execs_and_refuses_an_unguarded_start() -> None:
    import os
    import subprocess

    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux only")
    cores = sorted(os.sched_getaffinity(0))[:1]
    probe = ("import os, json; print(json.dumps([os.getpid(), sorted(os.sched_getaffinity(0)), "
             "os.environ['OMP_NUM_THREADS'], os.environ['DEEPSHARD_RESTART_COUNT'], os.environ['CROSS_RANK'], "
             "os.environ['CROSS_SIZE'], os.environ['FROM_JOB']]))")
    ajob = AgentJob([sys.executable, "-c", probe], 2, {"FROM_JOB": "y"}, [(), tuple(cores)])
    python, args = entry(ajob, os.getpid())
    env = {**os.environ, "LOCAL_RANK": "1", "TORCHELASTIC_RESTART_COUNT": "2", "GROUP_RANK": "1",
           "GROUP_WORLD_SIZE": "3"}
    out = subprocess.run([python, *args], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)[1:] == [cores, str(len(cores)), "2", "1", "3", "y"]
    _, unguarded = entry(ajob, 1)  # its parent is not pid 1: refuses to run without the death signal
    assert subprocess.run([python, *unguarded], env=env, timeout=30).returncode == 1


class _Beat:
    def __init__(self, lost: str | None) -> None:
        self.lost = lost


def _rendezvous(node_rank: int, channel: JobChannel, store: object) -> NodeRendezvous:
    rdzv = NodeRendezvous(HOSTS, node_rank, "127.0.0.1", 4000, "deepshard", "{}", {})
    rdzv.channel, rdzv._store, rdzv.round = channel, store, 0  # type: ignore[assignment]
    return rdzv


def test_agent_check_decisions() -> None:
    clock = Clock()
    node0, node1, node2 = _channels(clock=clock)
    rdzv0 = _rendezvous(0, node0, node0.store)
    assert rdzv0.check(force=True) is None
    node1.beat()
    node2.beat()
    assert rdzv0.check(force=True) is None
    clock.now = 11.0
    node1.beat()
    lost = rdzv0.check(force=True)  # node 2 went silent: node 0 ends the job for everyone
    assert lost is not None and (lost.kind, lost.node, lost.restartable) == ("lost", 2, False)
    assert "sent no heartbeat for 10 s" in lost.what and node1.abort() == lost and rdzv0.lost == [2]

    nodes = _channels()
    rdzv1 = _rendezvous(1, nodes[1], nodes[1].store)
    assert rdzv1.check(force=True) is None
    nodes[2].publish_failure(0, FAIL)
    assert rdzv1.check(force=True) == FAIL
    rdzv1._seen = None
    rdzv1._heartbeat = _Beat("Connection reset")  # type: ignore[assignment]
    gone = rdzv1.check(force=True)
    assert gone is not None and gone.kind == "lost" and gone.node == 0 and "Connection reset" in gone.what


def test_local_rank_failure_becomes_the_job_failure_first_one_wins() -> None:
    from deepshard.launcher.rank_streams import RankStream

    node0, node1, _ = _channels()
    stream = RankStream(3, 1, tail=bytearray(b"bye"), returncode=-9, pid=77)
    failure = _rendezvous(1, node1, node1.store).publish_rank_failure(stream)
    assert failure.headline() == "rank 3 (local rank 1, pid 77) on host node-b (node 1) exited with signal SIGKILL"
    assert (failure.exit_code, failure.rank, failure.tail, failure.restartable) == (1, 3, "bye", True)
    later = RankStream(0, 0, returncode=1, pid=5)
    assert _rendezvous(0, node0, node0.store).publish_rank_failure(later) == failure


def test_a_node_that_never_joined_is_named_and_not_waited_for_at_the_end() -> None:
    """Node 2 never starts: node 0's join names it when the timeout ends, and node 0 closes at once (node 1
    confirmed) instead of waiting EXIT_WAIT_S (15 s) for a node that never began."""
    clock = Clock()
    node0, node1, _ = _channels(clock=clock)
    rdzv0 = _rendezvous(0, node0, node0.store)
    rdzv0.round, rdzv0.join_timeout_s = -1, 3.0
    node1.store.set("round0/joined/1", "1")
    node1.mark_exited()

    def tick(_: float) -> None:
        clock.now += 0.5

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("deepshard.launcher.coordination.time.sleep", tick)
        with pytest.raises(TimeoutError, match="node 2 \\(node-c\\) did not join within 3 s"):
            rdzv0.next_rendezvous()
        joined_at = clock.now
        rdzv0.close()
    assert clock.now - joined_at < 1.0 and rdzv0.lost == [2]
