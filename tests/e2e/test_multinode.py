"""Two "machines" on this one: two ``deepshard --no_ssh --node_rank N`` launches sharing a hostfile and
``--master_addr 127.0.0.1`` train together; a rank that dies ends both; ``--max_restarts`` resumes
from the last checkpoint; a node agent killed outright is noticed by node 0 and takes its ranks along."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.e2e.test_launcher import ROOT, SCRIPTS, _clean_env, _deepshard, _gone

TRAIN = str(SCRIPTS / "multinode_train.py")


def free_port_pair() -> int:
    """A port P with P and P+1 free (the ranks' rendezvous and the agents' coordination store)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two consecutive free ports")


def start_node(node_rank: int, hostfile: Path, port: int, script_args: list[str], extra: list[str] = (),
               prefix: list[str] = (), master: str = "127.0.0.1", **env: str) -> subprocess.Popen:
    cmd = [*prefix, *_deepshard(), "-H", str(hostfile), "--no_ssh", "--node_rank", str(node_rank),
           "--master_addr", master, "--master_port", str(port), *extra, *script_args]
    return subprocess.Popen(cmd, cwd=ROOT, env=_clean_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    """Wait for every launch (killing all on timeout); (returncode, stdout, stderr) each."""
    deadline = time.monotonic() + timeout
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


def json_rows(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def rank_pids(text: str) -> list[int]:
    return [int(pid) for pid in re.findall(r"rank \d+ pid (\d+)", text)]


def test_two_no_ssh_nodes_train_as_one_world_of_four(tmp_path: Path) -> None:
    """Also what each rank knows of its machine: its local rank among LOCAL_WORLD_SIZE, its node (GROUP_RANK /
    CROSS_RANK) among GROUP_WORLD_SIZE (CROSS_SIZE) nodes; ``--num_nodes 2`` takes the first two hosts."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two machines\nnode-a slots=2\n\nnode-b slots=2  # the second\nnode-c slots=2\n")
    port, logs = free_port_pair(), tmp_path / "logs"
    args = [TRAIN, "--save_dir", str(tmp_path / "ckpt"), "--steps", "3"]
    extra = ["--num_nodes", "2", "--bind_cores_to_rank", "--enable_each_rank_log", str(logs)]
    procs = [start_node(1, hostfile, port, args, extra), start_node(0, hostfile, port, args, extra)]
    (rc1, out1, err1), (rc0, out0, err0) = finish(procs, 80)
    assert (rc0, rc1) == (0, 0), err0 + err1
    rows = {r["rank"]: r for r in json_rows(out0) + json_rows(out1)}
    assert sorted(rows) == [0, 1, 2, 3]
    assert sorted(r["rank"] for r in json_rows(out1)) == [2, 3]  # node 1 runs ranks 2 and 3 (hostfile order)
    for rank, row in rows.items():
        assert row["world"] == 4 and row["steps"] == 3 and row["start_step"] == 0
        assert (row["local_rank"], row["cross_rank"]) == (rank % 2, str(rank // 2))
        assert row["node"] == {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(rank // 2), "GROUP_WORLD_SIZE": "2",
                               "CROSS_SIZE": "2"}
    # every rank trained on other data; equal weights prove the gradients were averaged across both nodes
    assert len({round(r["checksum"], 10) for r in rows.values()}) == 1
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:  # --bind_cores_to_rank: each node splits the machine's cores among its 2 ranks
        half = len(cores) // 2
        assert [rows[r]["cores"] for r in (2, 3)] == [cores[:half], cores[half:2 * half]]
    for rank in range(4):
        assert f"rank {rank} attempt 0 starts at step 0" in (logs / f"rank_{rank}.log").read_text()


def test_rank_exit_ends_every_node_within_seconds(tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    port = free_port_pair()
    args = [TRAIN, "--save_dir", str(tmp_path / "ckpt"), "--steps", "50", "--fail_rank", "1", "--fail_after", "2"]
    procs = [start_node(1, hostfile, port, args), start_node(0, hostfile, port, args)]
    (rc1, out1, err1), (rc0, out0, err0) = finish(procs, 80)
    ended = time.time()
    died = re.search(r"rank 1 dying at step 2 at ([\d.]+)", out1)
    assert died is not None, out1 + err1
    assert ended - float(died.group(1)) < 30
    assert (rc0, rc1) == (3, 3), err0 + err1
    # node 0's launcher names the rank, its host and node, and shows the end of its output
    report = re.search(r"deepshard: rank 1 \(local rank 0, pid \d+\) on host node-b \(node 1\) exited with code 3\n"
                       r"----- last output of rank 1 \(host node-b\) -----\n(.*?)----- end of rank 1 output -----",
                       err0, re.S)
    assert report is not None, err0
    assert "rank 1 dying at step 2" in report.group(1)
    assert "exiting with code 3" in err0 and "exiting with code 3" in err1
    assert "on host node-b (node 1) exited with code 3" in err1  # the failing node reports too (--no_ssh)
    pids = rank_pids(err0) + rank_pids(err1)
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if not _gone(pid)] == []


def test_max_restarts_resumes_from_last_checkpoint(tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    port, ckpt = free_port_pair(), tmp_path / "ckpt"
    args = [TRAIN, "--save_dir", str(ckpt), "--steps", "6", "--fail_rank", "1", "--fail_after", "3"]
    extra = ["--max_restarts", "2"]
    procs = [start_node(1, hostfile, port, args, extra), start_node(0, hostfile, port, args, extra)]
    (rc1, out1, err1), (rc0, out0, err0) = finish(procs, 80)
    assert (rc0, rc1) == (0, 0), err0 + err1
    assert "rank 1 dying at step 3" in out1
    assert "restarting every rank (restart 1 of 2)" in err0 and "restarting every rank (restart 1 of 2)" in err1
    assert "rank 0 attempt 0 starts at step 0" in out0 and "rank 1 attempt 1 starts at step 3" in out1
    rows = json_rows(out0) + json_rows(out1)
    assert sorted(r["rank"] for r in rows) == [0, 1]
    for row in rows:  # the second attempt resumed at the checkpoint of step 3 and finished the 6 steps
        assert (row["restart"], row["start_step"], row["steps"], row["world"]) == (1, 3, 6, 2)
    assert rows[0]["checksum"] == rows[1]["checksum"]
    assert (ckpt / "latest").read_text() == "global_step6"


def test_killed_node_agent_is_detected_and_takes_its_ranks_along(tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    port = free_port_pair()
    script = [str(SCRIPTS / "sleep_forever.py")]
    env = {"DEEPSHARD_HEARTBEAT_TIMEOUT": "3"}
    node1 = start_node(1, hostfile, port, script, **env)
    node0 = start_node(0, hostfile, port, script, **env)
    try:
        rank1 = None
        while rank1 is None:
            line = node1.stdout.readline()  # type: ignore[union-attr]
            assert line, "node 1 ended before its rank started"
            found = re.search(r"rank 1 pid=(\d+) sleeping", line)
            rank1 = int(found.group(1)) if found else None
        node1.send_signal(signal.SIGKILL)  # the agent dies without a word
        killed = time.monotonic()
        (rc0, out0, err0), = finish([node0], 40)
        took = time.monotonic() - killed
    finally:
        finish([node1], 5)
    assert rc0 == 1, err0
    assert took < 20, f"node 0 needed {took:.1f} s to notice"
    assert re.search(r"the node agent on host node-b \(node 1\) sent no heartbeat for 3 s", err0), err0
    deadline = time.monotonic() + 5
    while not _gone(rank1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(rank1), "node 1's rank outlived its agent"
    pids = rank_pids(err0)
    assert pids and all(_gone(pid) for pid in pids)


def test_a_killed_node_is_named_even_when_a_rank_elsewhere_fails_first(tmp_path: Path) -> None:
    """Ranks in collectives: killing node 1's agent makes node 0's rank fail at once (its peer's
    connection closed); the report must name the lost node, not that rank."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    port = free_port_pair()
    script = [str(SCRIPTS / "allreduce_forever.py")]
    env = {"DEEPSHARD_HEARTBEAT_TIMEOUT": "8"}
    node1 = start_node(1, hostfile, port, script, **env)
    node0 = start_node(0, hostfile, port, script, **env)
    try:
        while True:
            line = node1.stdout.readline()  # type: ignore[union-attr]
            assert line, "node 1 ended before its rank started"
            if re.search(r"rank 1 pid=(\d+) sleeping", line):
                break
        time.sleep(0.5)
        node1.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        (rc0, out0, err0), = finish([node0], 40)
        took = time.monotonic() - killed
    finally:
        finish([node1], 5)
    assert rc0 == 1, err0
    headline = [line for line in err0.splitlines() if line.startswith("deepshard: ")][0]
    assert "the node agent on host node-b (node 1) sent no heartbeat" in headline, err0
    assert took < 25, f"node 0 needed {took:.1f} s"


def test_elastic_two_nodes_a_killed_node_agent_and_the_job_goes_on_without_it(tmp_path: Path) -> None:
    """``--elastic_training``: node 0 trains alone (``--min_elastic_nodes 1``) until node 1 arrives; torch's c10d
    rendezvous then restarts both in a world of two (not counted as a restart). Node 1's agent is killed
    outright; node 0's rank loses its peer, and with ``--max_restarts 1`` node 0's agent forms a new world
    without node 1 and finishes; node 1's rank died with its agent."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    port = free_port_pair()
    script = [str(SCRIPTS / "elastic_probe.py"), "--steps", "60"]
    extra = ["--elastic_training", "--min_elastic_nodes", "1", "--max_elastic_nodes", "2", "--max_restarts", "1"]
    node0 = start_node(0, hostfile, port, script, extra)  # it hosts the rendezvous store (both run here)
    line = ""
    while "of 1 attempt 0" not in line:
        line = node0.stdout.readline()  # type: ignore[union-attr]
        assert line, "node 0 ended before its rank started"
    node1 = start_node(1, hostfile, port, script, extra)
    try:
        line = ""
        while "of 2 attempt 0" not in line:
            line = node1.stdout.readline()  # type: ignore[union-attr]
            assert line, "node 1 ended before its rank started"
        rank1 = int(re.search(r"pid=(\d+)", line).group(1))  # type: ignore[union-attr]
        node1.send_signal(signal.SIGKILL)
        (rc0, out0, err0), = finish([node0], 120)
    finally:
        finish([node1], 5)
    assert rc0 == 0, out0 + err0
    assert re.search(r"rank 0 of 2 attempt 0 pid=\d+ sleeping LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 GROUP_RANK=0 "
                     r"GROUP_WORLD_SIZE=2", out0), out0
    # the job went on in a world without node 1, which every rank can see
    assert "rank 0 of 1 attempt 1 done LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 GROUP_RANK=0 GROUP_WORLD_SIZE=1" in out0, out0
    assert "restarting every rank (restart 1 of 1)" in err0, err0
    assert "1 node(s) waiting to join: restarting every rank in a new world" in err0, err0
    deadline = time.monotonic() + 5
    while not _gone(rank1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(rank1), "node 1's rank outlived its agent"


def test_agents_started_by_srun_or_mpirun_take_their_node_rank_from_the_runner(tmp_path: Path) -> None:
    """What ``srun`` / ``mpirun`` do with ``--launcher slurm|openmpi`` (one task per host, no --node_rank):
    node 0 is ``deepshard --no_ssh`` with Slurm's variables, node 1 the agent module with OpenMPI's; each
    reads its node rank from them and the four ranks follow the hostfile."""
    from deepshard.launcher.hostfile import encode_world_info

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=2\nnode-b slots=2\n")
    port = free_port_pair()
    script = [str(SCRIPTS / "allreduce.py")]
    node0 = subprocess.Popen([*_deepshard(), "-H", str(hostfile), "--no_ssh", "--master_addr", "127.0.0.1",
                              "--master_port", str(port), *script], cwd=ROOT, text=True,
                             env=_clean_env(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_NODEID="0"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    world = encode_world_info({"node-a": [0, 1], "node-b": [0, 1]})
    node1 = subprocess.Popen([sys.executable, "-u", "-m", "deepshard.launcher.node", "--world_info", world,
                              "--master_addr", "127.0.0.1", "--master_port", str(port), "--report_on_node0",
                              *script], cwd=ROOT, text=True,
                             env=_clean_env(OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    (rc0, out0, err0), (rc1, out1, err1) = finish([node0, node1], 90)
    assert (rc0, rc1) == (0, 0), err0 + err1
    assert "node rank 0 from SLURM_PROCID" in err0 and "node rank 1 from OMPI_COMM_WORLD_RANK" in err1
    found = {int(r): (int(lr), int(w)) for r, lr, w in
             re.findall(r"rank (\d) ok local_rank=(\d) env_local_rank=\d world=(\d)", out0 + out1)}
    assert found == {0: (0, 4), 1: (1, 4), 2: (0, 4), 3: (1, 4)}
    assert sorted(int(r) for r in re.findall(r"rank (\d) ok", out1)) == [2, 3]
