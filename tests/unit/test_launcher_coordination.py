"""The node agents' coordination protocol (on an in-memory store, and once on a real TCPStore), the
per-node rank plan, and the agent's stop decisions; no training processes."""
from __future__ import annotations

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
    coordination_port,
    open_store,
)
from deepshard.launcher.local import LocalLaunch, die_with_parent
from deepshard.launcher.node import (
    NodeJob,
    _Agent,
    _Watch,
    format_job_failure,
    plan_node_ranks,
)
from deepshard.launcher.options import LaunchError
from deepshard.launcher.supervisor import RankFailure

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
    assert coordination_port(29500) == 29501


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


def test_node_job_place_and_validation() -> None:
    job = _job(1)
    assert (job.host, job.world_size, job.hosts) == ("node-b", 5, HOSTS)
    place = job.place()
    assert (place.rank_offset, place.world_size, place.node_rank, place.num_nodes) == (2, 5, 1, 3)
    assert _job(2).place().rank_offset == 4
    with pytest.raises(LaunchError, match="--node_rank 3 is out of range.*0..2"):
        _job(3)
    with pytest.raises(LaunchError, match="--max_restarts -1"):
        _job(0, max_restarts=-1)
    assert _job(0).fingerprint() == _job(2).fingerprint() != _job(0, max_restarts=1).fingerprint()


def test_plan_node_ranks_global_ranks_and_environment() -> None:
    specs = plan_node_ranks(_job(1, bind=True), {"KEEP": "1"}, [0, 1, 2, 3], restart_count=2, python="py")
    assert [(s.rank, s.local_rank, s.slot) for s in specs] == [(2, 0, 0), (3, 1, 2)]
    env = specs[1].env
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE",
                                "MASTER_ADDR", "MASTER_PORT", "DEEPSHARD_RESTART_COUNT", "KEEP")} == \
        {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "5", "LOCAL_WORLD_SIZE": "2", "CROSS_RANK": "1",
         "CROSS_SIZE": "3", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "4000", "DEEPSHARD_RESTART_COUNT": "2",
         "KEEP": "1"}
    assert specs[1].cmd == ["py", "-u", "t.py", "--local_rank=1", "--x"]
    assert [s.cores for s in specs] == [(0, 1), (2, 3)] and env["OMP_NUM_THREADS"] == "2"
    guarded = plan_node_ranks(_job(1), {}, [0, 1], python="py", agent_pid=4242)
    if sys.platform.startswith("linux"):
        assert guarded[0].cmd[:2] == ["py", "-c"] and guarded[0].cmd[3:] == ["4242", "py", "-u", "t.py",
                                                                               "--local_rank=0", "--x"]


def test_die_with_parent_shim_execs_the_command() -> None:
    import os
    import subprocess

    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux only")
    out = subprocess.run(die_with_parent([sys.executable, "-c", "import os; print(os.getpid())"], os.getpid()),
                         capture_output=True, text=True, timeout=20)
    assert out.returncode == 0 and out.stdout.strip().isdigit()
    wrong_parent = subprocess.run(die_with_parent(["true"], 1), timeout=20)
    assert wrong_parent.returncode == 1  # its parent is not pid 1: refuses to run unguarded


class _Beat:
    def __init__(self, lost: str | None) -> None:
        self.lost = lost


def test_agent_check_decisions() -> None:
    clock = Clock()
    node0, node1, node2 = _channels(clock=clock)
    job0 = NodeJob({h: [0] for h in HOSTS}, 0, LocalLaunch("t.py", []))
    agent0 = _Agent(job0, node0, {}, [0], None, None, None)
    assert agent0.check(0) is None
    node1.beat()
    node2.beat()
    assert agent0.check(0) is None
    clock.now = 11.0
    node1.beat()
    lost = agent0.check(0)  # node 2 went silent: node 0 ends the job for everyone
    assert lost is not None and (lost.kind, lost.node, lost.restartable) == ("lost", 2, False)
    assert "sent no heartbeat for 10 s" in lost.what and node1.abort() == lost and agent0.lost == [2]

    nodes = _channels()
    agent1 = _Agent(NodeJob({h: [0] for h in HOSTS}, 1, LocalLaunch("t.py", [])), nodes[1], {}, [0],
                    None, None, None)  # type: ignore[arg-type]
    watch = _Watch(agent1, 0)
    assert watch() is None
    nodes[2].publish_failure(0, FAIL)
    assert watch(force=True) == FAIL.headline() and watch.failure == FAIL
    agent1.heartbeat = _Beat("Connection reset")  # type: ignore[assignment]
    gone = agent1.check(1)
    assert gone is not None and gone.kind == "lost" and gone.node == 0 and "Connection reset" in gone.what


def test_local_rank_failure_becomes_job_failure() -> None:
    from deepshard.launcher.node import failure_from_rank

    failure = failure_from_rank(_job(1), RankFailure(3, 1, 77, -9, "bye", None))
    assert failure.headline() == "rank 3 (local rank 1, pid 77) on host node-b (node 1) exited with signal SIGKILL"
    assert (failure.exit_code, failure.rank, failure.tail, failure.restartable) == (1, 3, "bye", True)


def test_a_node_that_never_joined_is_not_waited_for_at_the_end() -> None:
    """Node 2 never starts: node 0's join times out and it used to wait EXIT_WAIT_S (15 s) more for node 2
    to confirm the end of a job it never began. Now it closes at once (node 1 confirmed)."""
    clock = Clock()
    node0, node1, _ = _channels(clock=clock)
    agent0 = _Agent(NodeJob({h: [0] for h in HOSTS}, 0, LocalLaunch("t.py", [])), node0, {}, [0], None, None, None)
    node1.store.set("round0/joined/1", "1")
    node1.mark_exited()

    def tick(_: float) -> None:
        clock.now += 0.5

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("deepshard.launcher.coordination.time.sleep", tick)
        with pytest.raises(TimeoutError, match="node 2 \\(node-c\\) did not join within 3 s"):
            agent0.run(3.0)
        joined_at = clock.now
        agent0.close()
    assert clock.now - joined_at < 1.0 and agent0.lost == [2]
