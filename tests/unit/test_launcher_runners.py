"""The commands a multi-node launch runs, built without starting anything: node agent argv, the
remote shell line, ssh, pdsh, mpirun (OpenMPI, Hydra) and srun, and the launcher's plans."""
from __future__ import annotations

import shlex
import subprocess

import pytest

from deepshard.launcher.cli import parse_args
from deepshard.launcher.hostfile import decode_world_info, encode_world_info
from deepshard.launcher.multinode import check_ssh, node_agent_argv, plan_runners, process_flags, remote_shell_command
from deepshard.launcher.multinode import runner_command
from deepshard.launcher.options import LaunchError

WORLD = {"w0": [0, 1], "w1": [0, 1]}
AGENT = ["py", "-u", "train.py", "--lr", "1"]


def test_world_info_round_trip_keeps_order_and_rejects_garbage() -> None:
    world = {"zeta": [1, 3], "alpha": [0]}
    token = encode_world_info(world)
    assert shlex.quote(token) == token  # travels through a shell untouched
    decoded = decode_world_info(token)
    assert decoded == world and list(decoded) == ["zeta", "alpha"]
    for bad in ["!!!", encode_world_info({})[:-2], "W10="]:  # not base64, cut short, empty world
        with pytest.raises(ValueError, match="--world_info"):
            decode_world_info(bad)


def test_node_agent_argv() -> None:
    argv = node_agent_argv("TOKEN", 1, "10.0.0.1", 4000, "train.py", ["--x", "a b"], max_restarts=2,
                           process_flags=["--no_local_rank"], exit_on_stdin_close=True, python="py")
    assert argv == ["py", "-u", "-m", "deepshard.launcher.node", "--world_info", "TOKEN", "--node_rank=1",
                    "--master_addr", "10.0.0.1", "--master_port", "4000", "--max_restarts", "2",
                    "--exit_on_stdin_close", "--report_on_node0", "--no_local_rank", "train.py", "--x", "a b"]
    plain = node_agent_argv("T", 0, "h", 1, "t.py", [], python="py")
    assert "--max_restarts" not in plain and "--exit_on_stdin_close" not in plain
    numbered_by_runner = node_agent_argv("T", None, "h", 1, "t.py", [], python="py")
    assert not any(word.startswith("--node_rank") for word in numbered_by_runner)


def test_remote_shell_command_quotes_everything() -> None:
    line = remote_shell_command(["py", "t.py", "--msg", "it's here"], {"A": "1", "B": "x y;rm -rf /"},
                                "/work dir", venv_script="/opt/venv/bin/activate")
    assert line == (". /opt/venv/bin/activate && cd '/work dir' && export A=1 B='x y;rm -rf /' && "
                    "exec py t.py --msg 'it'\"'\"'s here'")
    # a shell reads it back into the same words
    assert shlex.split(line.split(" && exec ")[1]) == ["py", "t.py", "--msg", "it's here"]
    assert remote_shell_command(["py"], {}, "/w") == "cd /w && exec py"


def test_ssh_commands() -> None:
    assert runner_command("ssh", ["w1"], port=2222, extra=["-i", "key"], remote="cd /w && exec py") == \
        ["ssh", "-i", "key", "-p", "2222", "w1", "cd /w && exec py"]
    assert runner_command("ssh", ["w1"], remote="true") == ["ssh", "w1", "true"]
    seen: list[list[str]] = []
    check_ssh(["w1"], None, ["-o", "BatchMode=no"], run=lambda cmd, **kw: seen.append(cmd) or
              subprocess.CompletedProcess(cmd, 0, "", ""))
    # the user's options come first (ssh keeps the first value of an option)
    assert seen == [["ssh", "-o", "BatchMode=no", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "w1", "true"]]


def test_pdsh_command_node_rank_and_percent_escaping() -> None:
    args = _args("--ssh_port", "2222", "--launcher_args", "-u 30")
    args.user_args = ["--fmt=%d"]
    spec, = plan_runners(args, "pdsh", WORLD, "w0", {"P": "50%"}, {"PDSH_SSH_ARGS_APPEND": "-i key", "KEEP": "1"},
                         "/w", python="py")
    line = spec.cmd[-1]
    assert "--node_rank=%n" in line and "--fmt=%%d" in line and "P=50%%" in line
    assert line.count("%n") == 1
    assert spec.cmd == ["pdsh", "-S", "-R", "ssh", "-f", "1024", "-w", "w0,w1", "-u", "30", line]
    assert spec.env == {"PDSH_SSH_ARGS_APPEND": "-i key -p 2222", "KEEP": "1", "PDSH_RCMD_TYPE": "ssh"}
    assert "PDSH_SSH_ARGS_APPEND" not in plan_runners(_args(), "pdsh", WORLD, "w0", {}, {}, "/w")[0].env


def test_mpi_and_slurm_commands_start_one_agent_per_host() -> None:
    hosts = ["w0", "w1"]  # any slots: each agent starts its host's own
    assert runner_command("openmpi", hosts, AGENT, exports=["MASTER_ADDR", "NCCL_DEBUG"],
                          extra=["--mca", "btl", "^openib"]) == \
        ["mpirun", "-n", "2", "--host", "w0:1,w1:1", "--mca", "btl", "^openib", "-x", "MASTER_ADDR",
         "-x", "NCCL_DEBUG", *AGENT]
    for hydra in ("mpich", "impi", "mvapich"):
        assert runner_command(hydra, hosts, AGENT, exports=["A", "B"]) == \
            ["mpirun", "-n", "2", "-ppn", "1", "-hosts", "w0,w1", "-genvlist", "A,B", *AGENT]
    assert runner_command("mpich", ["w0"], AGENT, extra=["-v"])[:8] == \
        ["mpirun", "-n", "1", "-ppn", "1", "-hosts", "w0", "-v"]
    assert runner_command("slurm", hosts, AGENT, extra=["--partition", "gpu"]) == \
        ["srun", "--nodes", "2", "--ntasks", "2", "--ntasks-per-node", "1", "--nodelist", "w0,w1",
         "--kill-on-bad-exit=1", "--export=ALL", "--partition", "gpu", *AGENT]


def test_node_rank_from_the_runners_variables() -> None:
    from deepshard.launcher.node import with_node_rank

    for env, rank in (({"OMPI_COMM_WORLD_RANK": "3"}, 3), ({"PMI_RANK": "1", "SLURM_PROCID": "0"}, 1),
                      ({"PMIX_RANK": "4"}, 4), ({"MV2_COMM_WORLD_RANK": "5"}, 5), ({"SLURM_PROCID": "2"}, 2),
                      ({"SLURM_PROCID": "x"}, -1), ({}, -1)):  # -1: none found, --node_rank stays unset
        assert with_node_rank(_args("--no_ssh"), env).node_rank == rank, env
    assert with_node_rank(_args("--no_ssh"), {"SLURM_PROCID": "1"}).node_rank == 1
    assert with_node_rank(_args("--no_ssh", "--node_rank", "0"), {"SLURM_PROCID": "1"}).node_rank == 0


# ------------------------------------------------------------------------- the launcher's plans


def _args(*extra: str):
    return parse_args([*extra, "t.py", "--lr", "1"])


def test_plan_ssh_one_agent_per_node() -> None:
    args = _args("--ssh_port", "2222", "--launcher_args=-i /k -o 'ProxyJump j'", "--max_restarts", "1",
                 "--enable_each_rank_log", "logs", "--bind_cores_to_rank", "--master_port", "7000")
    specs = plan_runners(args, "ssh", WORLD, "w0", {"NCCL_DEBUG": "INFO"}, {"HOME": "/root"}, "/work", python="py")
    assert [s.label for s in specs] == ["node 0 (ssh w0)", "node 1 (ssh w1)"]
    assert all(s.stdin_pipe and s.env == {"HOME": "/root"} for s in specs)
    cmd = specs[1].cmd
    assert cmd[:7] == ["ssh", "-i", "/k", "-o", "ProxyJump j", "-p", "2222"] and cmd[7] == "w1"
    remote = cmd[8]
    assert remote.startswith("cd /work && export NCCL_DEBUG=INFO && exec py -u -m deepshard.launcher.node ")
    words = shlex.split(remote.split(" && exec ")[1])
    assert decode_world_info(words[words.index("--world_info") + 1]) == WORLD
    for expected in (["--node_rank=1"], ["--master_addr", "w0"], ["--master_port", "7000"],
                     ["--max_restarts", "1"], ["--enable_each_rank_log", "logs"], ["--bind_cores_to_rank"],
                     ["--exit_on_stdin_close"], ["t.py", "--lr", "1"]):
        i = words.index(expected[0])
        assert words[i:i + len(expected)] == expected
    assert words[-3:] == ["t.py", "--lr", "1"]


def test_plan_pdsh_single_command() -> None:
    spec, = plan_runners(_args("--ssh_port", "22"), "pdsh", WORLD, "w0", {}, {"X": "1"}, "/w", python="py")
    assert spec.cmd[:8] == ["pdsh", "-S", "-R", "ssh", "-f", "1024", "-w", "w0,w1"]
    assert "--node_rank=%n" in spec.cmd[-1] and "--exit_on_stdin_close" not in spec.cmd[-1]
    assert spec.env["PDSH_RCMD_TYPE"] == "ssh" and spec.env["PDSH_SSH_ARGS_APPEND"] == "-p 22"


def test_plan_mpi_starts_agents_exports_by_name_values_in_environment() -> None:
    args = _args("--master_port", "6000", "--launcher", "openmpi", "--launcher_args=--oversubscribe",
                 "--max_restarts", "2")
    spec, = plan_runners(args, "openmpi", WORLD, "w0", {"NCCL_DEBUG": "WARN", "SECRET": "s3"}, {"HOME": "/h"}, "/w",
                         python="py")
    assert spec.cmd[:9] == ["mpirun", "-n", "2", "--host", "w0:1,w1:1", "--oversubscribe", "-x", "NCCL_DEBUG",
                            "-x"]
    agent = spec.cmd[spec.cmd.index("py"):]
    assert agent[:4] == ["py", "-u", "-m", "deepshard.launcher.node"] and decode_world_info(agent[5]) == WORLD
    assert not any(w.startswith("--node_rank") for w in agent)  # each agent reads it from the runner
    for expected in (["--master_addr", "w0"], ["--master_port", "6000"], ["--max_restarts", "2"],
                     ["--report_on_node0"]):
        i = agent.index(expected[0])
        assert agent[i:i + len(expected)] == expected
    assert agent[-3:] == ["t.py", "--lr", "1"]
    assert "s3" not in " ".join(spec.cmd)  # values are not on the command line
    assert {k: spec.env[k] for k in ("HOME", "SECRET")} == {"HOME": "/h", "SECRET": "s3"}
    assert spec.label == "mpirun (2 node agents, 4 ranks)"
    mpich, = plan_runners(_args("--module"), "mpich", WORLD, "w0", {}, {}, "/w", python="py")
    assert "-genvlist" not in mpich.cmd and "--module" in mpich.cmd  # nothing to export; the agent runs -m
    srun, = plan_runners(_args(), "slurm", {"w0": [1]}, "w0", {}, {}, "/w", python="py")  # slots are the agent's to pick
    assert srun.cmd[0] == "srun" and srun.cmd[-3:] == ["t.py", "--lr", "1"]


def test_process_flags_forward_rank_options_only() -> None:
    args = _args("--module", "--no_local_rank", "--bind_core_list", "0-3", "--log_level", "debug", "-q",
                 "--num_gpus", "2", "--save_pid")
    assert process_flags(args) == ["--module", "--no_local_rank", "--quiet", "--bind_core_list", "0-3",
                                   "--log_level", "debug"]


def test_check_ssh_reports_every_unreachable_host() -> None:
    seen: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        seen.append(cmd)
        host = cmd[-2]
        if host == "bad":
            return subprocess.CompletedProcess(cmd, 255, "", "Permission denied (publickey).\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    check_ssh(["w0", "w1"], 2200, ["-i", "k"], run=fake_run)
    assert sorted(c[-2] for c in seen) == ["w0", "w1"]
    assert seen[0][:5] == ["ssh", "-i", "k", "-o", "BatchMode=yes"] and "2200" in seen[0]
    with pytest.raises(LaunchError, match="bad: Permission denied \\(publickey\\).*--no_ssh_check"):
        check_ssh(["w0", "bad"], None, [], run=fake_run)
