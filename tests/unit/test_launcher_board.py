"""The node agents' job board (on an in-memory store), a real c10d rendezvous opened and refused, the rendezvous
handler's own part (node ranks, missing nodes named, a fresh store per attempt, the watchdog), the per-node rank
plan, the rank shim, and the agent's stop decisions; no training processes."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousInfo

from deepshard.launcher.board import JobBoard, JobFailure, format_job_failure
from deepshard.launcher.cli import parse_args, plan_launch
from deepshard.launcher.local import TORCH_SETS
from deepshard.launcher.node import NodeJob, node_agent_job
from deepshard.launcher.options import LaunchError
from deepshard.launcher.output import Output
from deepshard.launcher.rank_streams import OUTPUT_ENV, STATUS_ENV, RankStream, RankStreams, shim_argv, watch_ranks
from deepshard.launcher.rendezvous import JobRendezvous, RendezvousFailed, open_rendezvous, watchdog
from deepshard.launcher.report import others_outcome

HOSTS = ["node-a", "node-b", "node-c"]
FAIL = JobFailure("rank", 1, "node-b", "rank 3 (local rank 1, pid 77)", "exited with code 3", 3, rank=3,
                  tail="line 1\nboom")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _boards(num_nodes: int = 3, clock: Clock | None = None) -> list[JobBoard]:
    store = dist.HashStore()
    return [JobBoard(store, n, HOSTS[:num_nodes], heartbeat_timeout_s=10.0, clock=clock or Clock())
            for n in range(num_nodes)]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_failure_record_round_trip_and_headline() -> None:
    assert JobFailure.from_json(FAIL.to_json()) == FAIL
    assert FAIL.headline() == "rank 3 (local rank 1, pid 77) on host node-b (node 1) exited with code 3"
    full = format_job_failure(FAIL, full=True)
    assert full.splitlines() == ["deepshard: rank 3 (local rank 1, pid 77) on host node-b (node 1) exited with code 3",
                                 "----- last output of rank 3 (host node-b) -----", "line 1", "boom",
                                 "----- end of rank 3 output -----"]
    assert format_job_failure(FAIL, full=False) == full.splitlines()[0]


def test_every_node_must_run_node_0s_job_and_a_node_rank_given_twice_is_named() -> None:
    node0, node1, node2 = _boards()
    for board in (node0, node1, node2):
        board.register('{"world": 1}')
    assert node1.check_job() is None and node2.missing() == []
    node1.register('{"world": 2}')
    problem = node1.check_job()
    assert problem is not None and "node 1's launch does not match node 0's" in problem and "only --node_rank" in problem
    assert node0.check_job() == node2.check_job() == problem  # every node refuses, node 0 too
    twice = _boards()
    for board in (twice[0], twice[1], JobBoard(twice[1].store, 1, HOSTS)):  # a second machine said --node_rank 1
        board.register("{}")
    problem = twice[0].check_job()
    assert problem is not None and problem.startswith("node 2 (node-c) did not register") and "same --node_rank" in problem


def test_first_failure_wins_and_attempts_are_separate() -> None:
    node0, node1, node2 = _boards()
    assert node0.failure(0) is None
    assert node1.publish_failure(0, FAIL) == FAIL
    later = JobFailure("rank", 2, "node-c", "rank 5", "exited with code 1", 1, rank=5)
    assert node2.publish_failure(0, later) == FAIL  # node 1 was first
    assert node0.failure(0) == FAIL and node0.failure(1) is None
    assert node0.abort() is None
    stop = JobFailure("abort", 0, "node-a", "the node agent", "received SIGINT", 130, restartable=False)
    assert node0.publish_abort(stop) == stop and node2.abort() == stop


def test_finished_counts_every_node() -> None:
    node0, node1, node2 = _boards()
    node0.mark_finished(0)
    node1.mark_finished(0)
    assert not node2.all_finished(0)
    node2.mark_finished(0)
    assert node0.all_finished(0) and not node0.all_finished(1)


def test_lost_nodes_by_heartbeat_counter_not_clocks() -> None:
    clock = Clock()
    node0, node1, node2 = _boards(clock=clock)
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
    late = _boards(clock=clock)[0]  # nodes that never beat have not started yet: not lost
    late.lost_nodes()
    clock.now = 100.0
    assert late.lost_nodes() == []


def test_wait_exited_skips_lost_nodes_and_nodes_that_never_came() -> None:
    node0, node1, node2 = _boards()
    for board in (node0, node1, node2):
        board.register("{}")
    node1.mark_exited()
    assert node0.wait_exited(0.0, skip=[2]) == []
    assert node0.wait_exited(0.0) == [2]
    threading.Timer(0.1, node2.mark_exited).start()
    t0 = time.monotonic()
    assert node0.wait_exited(10.0) == [] and time.monotonic() - t0 < 5  # node 2 left during the wait: it ends
    never = _boards()
    never[1].register("{}")
    never[1].mark_exited()
    assert never[0].wait_exited(0.0) == []  # node 2 never registered: nobody waits for it


def test_a_real_c10d_rendezvous_is_served_joined_and_refused_with_the_flag_to_change() -> None:
    port = _free_port()
    job = NodeJob({host: [0] for host in HOSTS[:2]}, 0, "t.py", [], "127.0.0.1", port)
    host = open_rendezvous(job, 1.0, is_host=True)
    client = open_rendezvous(replace(job, node_rank=1), 1.0, is_host=False)
    assert host.board is not None and client.board is not None and host.board.missing() == []
    client.board.publish_failure(0, FAIL)
    assert host.board.failure(0) == FAIL
    with socket.socket() as taken:  # another program holds the port (this process's own stores would share it)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(RendezvousFailed, match=f"node 0 cannot serve the rendezvous store at {busy}.*"
                                                   "pick another --master_port"):
            open_rendezvous(replace(job, master_port=taken.getsockname()[1]), 1.0, is_host=True)
    nowhere = replace(job, master_port=_free_port(), node_rank=1)
    with pytest.raises(RendezvousFailed, match="cannot reach the rendezvous store at 127.0.0.1:.*within 1 s"):
        open_rendezvous(nowhere, 1.0, is_host=False)


def _meet(*handlers: JobRendezvous) -> list[RendezvousInfo | Exception]:
    """Every handler's ``next_rendezvous`` at once (as on separate machines), first handler first; the infos, or
    what each raised."""
    found: list[RendezvousInfo | Exception] = [RuntimeError("no answer")] * len(handlers)

    def join(n: int) -> None:
        try:
            found[n] = handlers[n].next_rendezvous()
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            found[n] = exc

    threads = [threading.Thread(target=join, args=(n,), daemon=True) for n in range(len(handlers))]
    for thread in threads:
        thread.start()
        time.sleep(0.2)  # torch numbers the nodes by arrival (or creation): the first handler comes first
    for thread in threads:
        thread.join(60)
    return found


def _pair(hosts: list[str], node_ranks: tuple[int, int] = (0, 1), join_timeout_s: float = 1.0,
          restarts: tuple[int, int] = (0, 0)) -> tuple[JobRendezvous, JobRendezvous]:
    """Two nodes of a static job in a real c10d rendezvous: the first serves its store."""
    job = NodeJob({host: [0] for host in hosts}, node_ranks[0], "t.py", [], "127.0.0.1", _free_port(),
                  max_restarts=restarts[0])
    host = open_rendezvous(job, join_timeout_s, is_host=True)
    client = open_rendezvous(replace(job, node_rank=node_ranks[1], max_restarts=restarts[1]), join_timeout_s,
                             is_host=False)
    return host, client


def test_static_node_ranks_come_from_the_hostfile_and_each_attempt_gets_a_fresh_store() -> None:
    first, second = _pair(HOSTS[:2], node_ranks=(1, 0), join_timeout_s=30.0)  # torch numbers the server 0
    ports = []
    try:
        for _ in range(2):  # two attempts
            info, theirs = _meet(first, second)
            assert isinstance(info, RendezvousInfo) and isinstance(theirs, RendezvousInfo), (info, theirs)
            assert (info.rank, info.world_size, theirs.rank) == (1, 2, 0)
            assert theirs.bootstrap_store_info.master_addr == "127.0.0.1"
            assert theirs.bootstrap_store_info.master_port == info.bootstrap_store_info.master_port
            ports.append(theirs.bootstrap_store_info.master_port)
        assert first.use_agent_store and first.get_run_id() == "deepshard"
    finally:
        first.shutdown()
        second.shutdown()
    assert ports[0] != ports[1] and first.job.master_port not in ports  # a new store each attempt, never torch's own


def test_a_node_that_never_joined_is_named_and_a_mismatched_job_refused() -> None:
    node0, node1 = _pair(HOSTS)  # node 2 never comes
    try:
        late, = _meet(node0)
        assert isinstance(late, RendezvousFailed) and re.match(
            r"attempt 0: node 2 \(node-c\) did not join within 1 s \(DEEPSHARD_JOIN_TIMEOUT\).*127.0.0.1:",
            str(late)), late
    finally:
        node0.shutdown()
        node1.shutdown()
    node0, node1 = _pair(HOSTS[:2], restarts=(0, 1))  # node 1 was told --max_restarts 1
    try:
        wrong = _meet(node0, node1)
        assert all(isinstance(e, LaunchError) and "does not match node 0's" in str(e) for e in wrong), wrong
    finally:
        node0.shutdown()
        node1.shutdown()


def test_the_watchdog_names_what_it_waited_for() -> None:
    said: list[str] = []
    fired = threading.Event()
    expire = lambda message: (said.append(message), fired.set())  # noqa: E731
    with watchdog("attempt 3: the nodes meeting", 0.05, expire):
        assert fired.wait(5)
    with watchdog("quick", 5.0, expire):
        pass
    assert said == ["attempt 3: the nodes meeting: still waiting after 0 s; giving up (the job cannot go on)"]


# --------------------------------------------------------------------------------- the node agent


def _job(node_rank: int = 1, **kw: object) -> NodeJob:
    return NodeJob({"node-a": [0, 1], "node-b": [0, 2], "node-c": [0]}, node_rank, "t.py", ["--x"], "10.0.0.1", 4000,
                   bind_cores=bool(kw.pop("bind", False)), **kw)  # type: ignore[arg-type]


def test_node_job_hosts_and_validation() -> None:
    job = _job(1)
    assert (job.host, job.hosts) == ("node-b", HOSTS)
    with pytest.raises(LaunchError, match="--node_rank 3 is out of range.*0..2"):
        _job(3)
    with pytest.raises(LaunchError, match="--max_restarts -1 must be >= 0"):
        plan_launch(parse_args(["--max_restarts", "-1", "t.py"]), {}, None, None, [0], {"localhost"})
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


def test_rank_shim_binds_sets_runs_reports_and_refuses_an_unguarded_start(tmp_path: Path) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux only")
    cores = sorted(os.sched_getaffinity(0))[:1]
    probe = ("import os, json, sys; print(json.dumps([os.getpid(), sorted(os.sched_getaffinity(0)), "
             "os.environ['OMP_NUM_THREADS'], os.environ['DEEPSHARD_RESTART_COUNT'], os.environ['CROSS_RANK'], "
             "os.environ['CROSS_SIZE'], os.environ['FROM_JOB'], 'DEEPSHARD_RANK_STATUS' in os.environ])); sys.exit(3)")
    python, args = shim_argv([sys.executable, "-c", probe], os.getpid(), [(), tuple(cores)], {"FROM_JOB": "y"}, False)
    seen: list[tuple[str, tuple[int, ...]]] = []
    status = str(tmp_path / "status")
    unwatch = watch_ranks(status, lambda *a: seen.append(("start", a)), lambda *a: seen.append(("exit", a)))
    output = tmp_path / "output"
    os.mkfifo(output)
    reader = os.open(output, os.O_RDONLY | os.O_NONBLOCK)
    env = {**os.environ, "LOCAL_RANK": "1", "TORCHELASTIC_RESTART_COUNT": "2", "GROUP_RANK": "1",
           "GROUP_WORLD_SIZE": "3", STATUS_ENV: status, OUTPUT_ENV: str(output)}
    shim = subprocess.run([python, *args], env=env, capture_output=True, text=True, timeout=30, start_new_session=True)
    unwatch()
    assert shim.returncode == 3 and shim.stdout == "", shim.stderr  # the rank's output went to its pipe
    with os.fdopen(reader, "rb") as pipe:
        report = json.loads(pipe.read().decode())
    assert report[1:] == [cores, str(len(cores)), "2", "1", "3", "y", False]
    (start, (local, pid, group)), (end, exited) = seen
    assert (start, local, pid, end, exited) == ("start", 1, report[0], "exit", (1, report[0], 3))
    assert group != os.getpgid(0)  # torch starts each shim in its own session: the agent stops the whole group
    _, unguarded = shim_argv(["true"], 1, None, {}, False)  # its parent is not pid 1: refuses to run
    assert subprocess.run([python, *unguarded], env=env, timeout=30).returncode == 1


def test_agent_check_decisions() -> None:
    clock = Clock()
    node0, node1, node2 = _boards(clock=clock)
    link0 = node0
    assert link0.check(0, force=True) is None
    node1.beat()
    node2.beat()
    assert link0.check(0, force=True) is None
    clock.now = 11.0
    node1.beat()
    lost = link0.check(0, force=True)  # node 2 went silent: node 0 ends the job for everyone
    assert lost is not None and (lost.kind, lost.node, lost.restartable) == ("lost", 2, False)
    assert "sent no heartbeat for 10 s" in lost.what and node1.abort() == lost and link0.lost == [2]

    boards = _boards()
    link1 = boards[1]
    assert link1.check(0, force=True) is None
    boards[2].publish_failure(0, FAIL)
    assert link1.check(0, force=True) == FAIL
    link1.new_attempt()
    assert link1.check(1, force=True) is None  # the next attempt starts clean

    link1.heartbeat_lost = "Connection reset"  # what the heartbeat sets once node 0's store stops answering
    link1.new_attempt()
    gone = link1.check(1, force=True)
    assert gone is not None and gone.kind == "lost" and gone.node == 0 and "Connection reset" in gone.what


def test_local_rank_failure_becomes_the_job_failure_first_one_wins() -> None:
    node0, node1, _ = _boards()
    stream = RankStream(3, 1, tail=bytearray(b"bye"), returncode=-9, pid=77)
    failure = node1.publish_rank_failure(0, stream)
    assert failure.headline() == "rank 3 (local rank 1, pid 77) on host node-b (node 1) exited with signal SIGKILL"
    assert (failure.exit_code, failure.rank, failure.tail, failure.restartable) == (1, 3, "bye", True)
    later = RankStream(0, 0, returncode=1, pid=5)
    assert node0.publish_rank_failure(0, later) == failure



def _streams(*codes: int | None) -> RankStreams:
    streams = RankStreams(Output())
    streams.streams = {i: RankStream(i, i, returncode=code, pid=100 + i) for i, code in enumerate(codes)}
    return streams


@pytest.mark.parametrize("codes, stopped, said", [
    ((1, None), {1}, "; stopped the other 1 rank"),  # rank 1 was running when rank 0 failed
    ((1, 1), set(), "; the other 1 rank failed too"),  # every rank failed on its own
    ((1, 2, -15, -15), {2, 3}, "; 1 other rank failed too; stopped 2 other ranks"),
    ((1, 0), set(), ""),  # the other had finished (named by the early-exit line instead)
    ((1,), set(), ""),
])
def test_the_report_says_what_became_of_the_other_ranks(codes: tuple, stopped: set, said: str) -> None:
    streams = _streams(*codes)
    try:
        assert others_outcome(streams, streams.streams[0], stopped) == said
    finally:
        streams.cleanup()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_the_shim_outlives_a_signalled_rank_reports_it_and_ends_by_its_signal(tmp_path: Path, sig: int) -> None:
    """torch and the agent signal the whole process group: the rank gets the signal once (the shim does not
    pass it on again), and the shim, which ignores it, reports the rank's death and dies of the same signal; a
    rank killed alone (the kernel's OOM killer) is reported the same way."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux only")
    rank = ("import signal, sys, time\n"
            "got = []\n"
            "signal.signal(signal.SIGTERM, lambda s, f: got.append(s))\n"
            "print('ready', flush=True)\n"
            "while not got: time.sleep(0.01)\n"
            "time.sleep(0.3)\n"
            "print('got', len(got), flush=True)\n"
            "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
            "signal.raise_signal(signal.SIGTERM)\n")
    if sig == signal.SIGKILL:
        rank = "import time\nprint('ready', flush=True)\ntime.sleep(30)\n"
    python, args = shim_argv([sys.executable, "-c", rank], os.getpid(), None, {}, False)
    seen: list[tuple[str, tuple[int, ...]]] = []
    status = str(tmp_path / "status")
    unwatch = watch_ranks(status, lambda *a: seen.append(("start", a)), lambda *a: seen.append(("exit", a)))
    output = tmp_path / "output"
    os.mkfifo(output)
    reader = os.open(output, os.O_RDONLY | os.O_NONBLOCK)
    env = {**os.environ, "LOCAL_RANK": "0", STATUS_ENV: status, OUTPUT_ENV: str(output)}
    shim = subprocess.Popen([python, *args], env=env, start_new_session=True)
    deadline = time.monotonic() + 30
    while not seen and time.monotonic() < deadline:  # the shim holds the pipe once it reported the start
        time.sleep(0.01)
    os.set_blocking(reader, True)
    with os.fdopen(reader, "rb") as pipe:
        assert pipe.readline() == b"ready\n"
        if sig == signal.SIGTERM:
            os.killpg(shim.pid, sig)  # as torch's agent and deepshard's stop do
        else:
            os.kill(seen[0][1][1], sig)
        said = pipe.read().decode()
    assert shim.wait(30) == -sig
    unwatch()
    assert [kind for kind, _ in seen] == ["start", "exit"] and seen[1][1][2] == -sig
    assert said == ("got 1\n" if sig == signal.SIGTERM else "")
