"""Two nodes with their own network stacks: network namespaces joined by a veth pair (10.200.0.1 and
10.200.0.2, created and removed by this module; no traffic leaves them). ``--no_ssh`` launches, one
per namespace; then the ssh path (and pdsh where installed) against an sshd started in each namespace
by the test. Skipped, with the reason, where namespaces cannot be made (not root, no ``ip``, no
permission) or sshd / ssh / ssh-keygen are not installed."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.test_launcher import ROOT, SCRIPTS, _clean_env, _deepshard, _gone, sleeping_pids
from tests.e2e.test_multinode import finish, rank_pids, start_node

ADDRESSES = ("10.200.0.1", "10.200.0.2")
SSH_PORT = 2222
SSHD = "/usr/sbin/sshd"


@dataclass(frozen=True)
class Namespaces:
    names: tuple[str, str]

    def prefix(self, node: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[node]]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


@pytest.fixture(scope="module")
def netns() -> Iterator[Namespaces]:
    if os.geteuid() != 0:
        pytest.skip(f"network namespaces need root; running as uid {os.geteuid()}")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's 'ip' is not installed (apt-get install iproute2)")
    tag = os.getpid() % 100000
    names = (f"dsA{tag}", f"dsB{tag}")
    made: list[str] = []
    try:
        for name in names:
            _ip("netns", "add", name)
            made.append(name)
        # veth ends with different names on purpose: deepshard picks gloo's interface by route
        _ip("link", "add", f"dsa{tag}", "netns", names[0], "type", "veth", "peer", "name", f"dsb{tag}",
            "netns", names[1])
        for name, dev, addr in zip(names, (f"dsa{tag}", f"dsb{tag}"), ADDRESSES):
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", name, "link", "set", dev, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        subprocess.run(["ip", "netns", "exec", names[0], "true"], check=True, capture_output=True, text=True,
                       timeout=20)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
        detail = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) and exc.stderr else exc
        pytest.skip(f"cannot create network namespaces / a veth pair here: {' '.join(exc.cmd)}: {detail}")
    try:
        yield Namespaces(names)
    finally:
        for name in names:  # deleting a namespace deletes its veth end, and with it the pair
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


def test_no_ssh_nodes_in_two_namespaces(netns: Namespaces, tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{ADDRESSES[0]} slots=1\n{ADDRESSES[1]} slots=1\n")
    script = [str(SCRIPTS / "allreduce.py")]
    procs = [start_node(n, hostfile, 29500, script, prefix=netns.prefix(n), master=ADDRESSES[0])
             for n in (1, 0)]
    (rc1, out1, err1), (rc0, out0, err0) = finish(procs, 60)
    assert (rc0, rc1) == (0, 0), err0 + err1
    assert "rank 0 ok local_rank=0 env_local_rank=0 world=2" in out0
    assert "rank 1 ok local_rank=0 env_local_rank=0 world=2" in out1
    assert re.search(r"using interface dsa\d+ \(the route to MASTER_ADDR 10\.200\.0\.1\)", err0 + out0), err0


@dataclass(frozen=True)
class SshSetup:
    launcher_args: str
    client_opts: list[str]


def _wait_for_sshd(netns: Namespaces, opts: list[str], procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 10
    for addr in ADDRESSES:
        while True:
            probe = subprocess.run([*netns.prefix(0), "ssh", *opts, "-o", "BatchMode=yes", "-o", "ConnectTimeout=2",
                                    "-p", str(SSH_PORT), addr, "true"], capture_output=True, text=True, timeout=15)
            if probe.returncode == 0:
                break
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                logs = " | ".join((p.stderr.read() if p.poll() is not None else "") for p in procs)  # type: ignore[union-attr]
                pytest.skip(f"sshd in the namespaces did not accept a key login: {probe.stderr.strip()} {logs}")
            time.sleep(0.2)


@pytest.fixture(scope="module")
def sshd(netns: Namespaces, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshSetup]:
    missing = [tool for tool in ("ssh", "ssh-keygen") if shutil.which(tool) is None]
    if not os.path.exists(SSHD):
        missing.append(SSHD)
    if missing:
        pytest.skip(f"ssh test needs OpenSSH: {', '.join(missing)} not installed "
                    "(apt-get install openssh-server openssh-client)")
    keys = tmp_path_factory.mktemp("ssh")
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)], check=True, timeout=30)
    shutil.copy(keys / "client_key.pub", keys / "authorized_keys")
    try:
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
    except OSError as exc:
        pytest.skip(f"sshd needs /run/sshd, which cannot be created here: {exc}")
    procs = []
    try:
        for node, addr in enumerate(ADDRESSES):
            config = keys / f"sshd_{node}.conf"
            config.write_text(
                f"Port {SSH_PORT}\nListenAddress {addr}\nHostKey {keys / 'host_key'}\n"
                f"AuthorizedKeysFile {keys / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                f"PidFile {keys / f'sshd_{node}.pid'}\nLogLevel ERROR\n")
            procs.append(subprocess.Popen([*netns.prefix(node), SSHD, "-D", "-e", "-f", str(config)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        opts = ["-F", "/dev/null", "-i", str(keys / "client_key"), "-o", "StrictHostKeyChecking=no",
                "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]
        _wait_for_sshd(netns, opts, procs)
        yield SshSetup(" ".join(opts), opts)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _ssh_launch(netns: Namespaces, hostfile: Path, args: list[str], **env: str) -> subprocess.Popen:
    cmd = [*netns.prefix(0), *_deepshard(), "-H", str(hostfile), "--master_port", "29500", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=_clean_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.fixture
def two_hosts(tmp_path: Path) -> Path:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{ADDRESSES[0]} slots=1\n{ADDRESSES[1]} slots=1\n")
    return hostfile


def test_ssh_launch_runs_and_reports_a_remote_failure(netns: Namespaces, sshd: SshSetup, two_hosts: Path) -> None:
    ssh = ["--launcher", "ssh", "--ssh_port", str(SSH_PORT), f"--launcher_args={sshd.launcher_args}"]
    (rc, out, err), = finish([_ssh_launch(netns, two_hosts, [*ssh, str(SCRIPTS / "allreduce.py"), "--x=50%"])], 60)
    assert rc == 0, out + err
    assert "rank 0 ok local_rank=0 env_local_rank=0 world=2 omp=" in out
    assert "rank 1 ok local_rank=0 env_local_rank=0 world=2" in out and "extra=['--x=50%']" in out
    # rank 1 (on 10.200.0.2) raises; rank 0 sleeps: the whole job ends, named by node 0's agent
    proc = _ssh_launch(netns, two_hosts, [*ssh, str(SCRIPTS / "fail_rank1.py")])
    (rc, out, err), = finish([proc], 60)
    assert rc == 1, out + err
    assert re.search(r"deepshard: rank 1 \(local rank 0, pid \d+\) on host 10\.200\.0\.2 \(node 1\) exited with "
                     r"code 1\n----- last output of rank 1 \(host 10\.200\.0\.2\) -----\n", out), out
    assert "RuntimeError: boom from rank 1: deliberate failure" in out
    assert "the job failed with exit code 1" in err
    pids = rank_pids(out)  # from the agents' "started 1 ranks: rank N pid P" lines, via ssh
    helper = re.search(r"rank 0 pid=\d+ helper_pid=(\d+)", out)  # printed unless stopped first
    pids += [int(helper.group(1))] if helper else []
    assert len(pids) >= 2
    deadline = time.monotonic() + 5
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if not _gone(pid)] == []


def test_killing_the_ssh_launcher_leaves_no_remote_process(netns: Namespaces, sshd: SshSetup,
                                                           two_hosts: Path) -> None:
    ssh = ["--launcher", "ssh", "--ssh_port", str(SSH_PORT), f"--launcher_args={sshd.launcher_args}"]
    proc = _ssh_launch(netns, two_hosts, [*ssh, str(SCRIPTS / "sleep_forever.py")])
    pids: list[int] = []
    try:
        pids = sleeping_pids(proc, 2)
        proc.kill()  # SIGKILL: nothing forwarded; the remote agents see their ssh stdin close
        proc.wait()
        deadline = time.monotonic() + 15
        while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        finish([proc], 5)
    assert [pid for pid in pids if not _gone(pid)] == []


def test_pdsh_launch(netns: Namespaces, sshd: SshSetup, two_hosts: Path) -> None:
    if shutil.which("pdsh") is None:
        pytest.skip("pdsh is not installed (apt-get install pdsh); the ssh launch is tested above")
    args = ["--launcher", "pdsh", "--ssh_port", str(SSH_PORT), "--no_ssh_check", str(SCRIPTS / "allreduce.py"),
            "--fmt=%d"]
    (rc, out, err), = finish([_ssh_launch(netns, two_hosts, args, PDSH_SSH_ARGS_APPEND=sshd.launcher_args)], 60)
    assert rc == 0, out + err
    assert re.search(r"^10\.200\.0\.1: rank 0 ok .* world=2 .*extra=\['--fmt=%d'\]$", out, re.M), out
    assert re.search(r"^10\.200\.0\.2: rank 1 ok .* world=2 ", out, re.M), out
    assert rank_pids(err) == []  # the launcher itself started only pdsh
