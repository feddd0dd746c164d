"""Launcher and init_distributed logic without processes: hostfiles, node specs, rank assignment, the
command line, per-rank commands and environments, and the distributed environment resolution."""
from __future__ import annotations

import datetime
import json
import os
import socket
import sys
from pathlib import Path

import pytest

from deepshard.distributed import DistEnv, _first_host, default_timeout, resolve_dist_env
from deepshard.launcher.cli import LaunchError, launch_mode, parse_args, plan_launch, select_nodes
from deepshard.launcher.hostfile import (
    parse_hostfile,
    parse_node_spec,
    read_hostfile,
    resolve_resources,
)
from deepshard.launcher.local import (
    build_rank_command,
    omp_threads,
    parse_core_list,
    split_cores,
)

NAMES = {"localhost", "127.0.0.1", "thishost"}

# ----------------------------------------------------------------------------------------- hostfile


def test_parse_hostfile_keeps_order_comments_and_blank_lines() -> None:
    text = "# cluster\n\nworker-1 slots=4\nworker-0 slots=2   # trailing comment\n   \n#worker-9 slots=8\n"
    hosts = parse_hostfile(text)
    assert hosts == {"worker-1": 4, "worker-0": 2}
    assert list(hosts) == ["worker-1", "worker-0"]


def test_parse_hostfile_duplicate_host_names_both_lines() -> None:
    with pytest.raises(ValueError) as err:
        parse_hostfile("a slots=1\nb slots=2\n\na slots=3\n", source="hf")
    message = str(err.value)
    assert "hf:4" in message and "'a'" in message and "line 1" in message and "a slots=3" in message


@pytest.mark.parametrize("line", ["worker-1 4", "worker-1 slots=four", "worker-1 slots=4 extra", "slots=4"])
def test_parse_hostfile_bad_line_names_line_number_and_form(line: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_hostfile(f"ok slots=1\n# c\n{line}\n", source="myhosts")
    message = str(err.value)
    assert message.startswith("myhosts:3:") and repr(line) in message and "slots=<count>" in message


def test_parse_hostfile_rejects_zero_slots_and_empty_file() -> None:
    with pytest.raises(ValueError, match="slots=0"):
        parse_hostfile("a slots=0\n")
    with pytest.raises(ValueError, match="lists no hosts"):
        parse_hostfile("# nothing here\n\n")


def test_read_hostfile_missing_and_present(tmp_path) -> None:
    assert read_hostfile(str(tmp_path / "nope")) is None
    path = tmp_path / "hostfile"
    path.write_text("n1 slots=2\nn2 slots=1\n")
    assert read_hostfile(str(path)) == {"n1": 2, "n2": 1}
    path.write_text("n1 slots=2\nn1 slots=1\n")
    with pytest.raises(ValueError, match=f"{path}:2"):
        read_hostfile(str(path))


# ---------------------------------------------------------------------------------------- node spec


def test_parse_node_spec() -> None:
    assert parse_node_spec("worker-0@worker-1:0,2") == {"worker-0": None, "worker-1": [0, 2]}
    assert parse_node_spec("a:3,1@a:2") == {"a": [1, 2, 3]}
    assert parse_node_spec("a:1@a") == {"a": None}
    for bad in ["a@@b", "a:x", ":1", "a:1,", ""]:
        with pytest.raises(ValueError):
            parse_node_spec(bad)


RES = {"w0": 4, "w1": 4, "w2": 2}


def test_include_selects_hosts_and_slots_in_hostfile_order() -> None:
    assert resolve_resources(RES, include="w1:0,2@w0") == {"w0": [0, 1, 2, 3], "w1": [0, 2]}


def test_include_unknown_host_or_slot_is_named() -> None:
    with pytest.raises(ValueError, match="'w7'.*not in the hostfile"):
        resolve_resources(RES, include="w7")
    with pytest.raises(ValueError, match="slot 2 of host 'w2', which has 2 slots"):
        resolve_resources(RES, include="w2:2")


def test_exclude_removes_slots_and_empty_hosts() -> None:
    assert resolve_resources(RES, exclude="w0:1@w2:0,1") == {"w0": [0, 2, 3], "w1": [0, 1, 2, 3]}
    assert resolve_resources(RES, exclude="w1") == {"w0": [0, 1, 2, 3], "w2": [0, 1]}
    with pytest.raises(ValueError, match="no slots left"):
        resolve_resources({"a": 1}, exclude="a:0")


def test_include_exclude_conflicts() -> None:
    with pytest.raises(ValueError, match="mutually exclusive"):
        resolve_resources(RES, include="w0", exclude="w1")
    with pytest.raises(ValueError, match="Cannot specify num_nodes/gpus with include/exclude") as err:
        resolve_resources(RES, include="w0", num_gpus=2)
    assert "drop --num_nodes/--num_gpus" in str(err.value)
    with pytest.raises(ValueError, match="Cannot specify num_nodes/gpus with include/exclude"):
        resolve_resources(RES, exclude="w0", num_nodes=1)


def test_num_nodes_and_num_gpus() -> None:
    assert resolve_resources(RES, num_nodes=2) == {"w0": [0, 1, 2, 3], "w1": [0, 1, 2, 3]}
    assert resolve_resources(RES, num_gpus=2) == {"w0": [0, 1], "w1": [0, 1], "w2": [0, 1]}
    assert resolve_resources(RES, num_nodes=1, num_gpus=3) == {"w0": [0, 1, 2]}
    with pytest.raises(ValueError, match="--num_gpus 3 .* host 'w2' has \\(2\\)"):
        resolve_resources(RES, num_gpus=3)
    with pytest.raises(ValueError, match="--num_nodes 4 .* 3 available"):
        resolve_resources(RES, num_nodes=4)


# ------------------------------------------------------------------------------------- command line


def test_user_script_and_args_are_left_untouched() -> None:
    args = parse_args(["--num_gpus", "2", "train.py", "--deepspeed", "--deepspeed_config", "c.json",
                       "--num_gpus", "7", "-q"])
    assert args.num_gpus == 2 and args.user_script == "train.py" and not args.quiet
    assert args.user_args == ["--deepspeed", "--deepspeed_config", "c.json", "--num_gpus", "7", "-q"]


def test_flag_defaults_and_aliases() -> None:
    args = parse_args(["--num_accelerators", "3", "-i", "localhost:0", "--master_port", "1234",
                       "--launcher", "slurm", "--no_ssh", "--node_rank", "1", "x.py"])
    assert (args.num_gpus, args.include, args.master_port, args.launcher, args.no_ssh, args.node_rank) == \
        (3, "localhost:0", 1234, "slurm", True, 1)
    defaults = parse_args(["x.py"])
    assert (defaults.hostfile, defaults.master_port, defaults.master_addr, defaults.num_nodes,
            defaults.num_gpus, defaults.user_args, defaults.launcher, defaults.max_restarts) == \
        ("/job/hostfile", 29500, "", -1, -1, [], "pdsh", 0)


def test_build_rank_command_variants() -> None:
    # --local_rank right after the script, as DeepSpeed's launcher places it
    assert build_rank_command("t.py", ["--a", "1"], 3, python="py") == ["py", "-u", "t.py", "--local_rank=3",
                                                                         "--a", "1"]
    assert build_rank_command("pkg.train", [], 0, module=True, python="py") == \
        ["py", "-u", "-m", "pkg.train", "--local_rank=0"]
    assert build_rank_command("./run.sh", ["x"], 1, no_python=True, no_local_rank=True) == ["./run.sh", "x"]
    with pytest.raises(ValueError, match="--module and --no_python"):
        _plan(["--module", "--no_python", "m"])


def test_core_list_split_and_omp_threads() -> None:
    assert parse_core_list("0,3-5,4") == [0, 3, 4, 5]
    for bad in ["a", "3-1", "1-"]:
        with pytest.raises(ValueError):
            parse_core_list(bad)
    assert split_cores([0, 1, 2, 3, 4], 2) == [(0, 1), (2, 3)]
    with pytest.raises(ValueError, match="cannot bind 3 ranks to 2 cores"):
        split_cores([0, 1], 3)
    assert omp_threads({}, 2, 2, None) == 1
    assert omp_threads({}, 2, 4, None) == 1
    assert omp_threads({}, 16, 4, None) == 4
    assert omp_threads({"OMP_NUM_THREADS": "7"}, 16, 4, None) is None
    assert omp_threads({"OMP_NUM_THREADS": "7"}, 16, 4, 2) == 2


def _plan(argv: list[str], hostfile: dict[str, int] | None = None, cuda: list[str] | None = None,
          cores: list[int] | None = None, environ: dict[str, str] | None = None):
    return plan_launch(parse_args(argv), environ or {}, hostfile, cuda, cores or [0, 1], NAMES)


def test_plan_cpu_default_is_one_process_and_num_gpus_sets_count() -> None:
    only = _plan(["t.py"])
    assert only.nproc == 1 and only.argv == [sys.executable, "-u", "t.py", "--local_rank=${local_rank}"]
    assert "CUDA_VISIBLE_DEVICES" not in only.rank_env
    job = _plan(["--num_gpus", "3", "t.py", "--lr", "1"], cores=[0, 1, 2, 3, 4, 5])
    assert job.nproc == 3 and job.argv[-4:] == ["t.py", "--local_rank=${local_rank}", "--lr", "1"]
    assert job.rank_env["OMP_NUM_THREADS"] == "2" and job.cores is None


def test_plan_cpu_include_localhost_slots_and_aliases() -> None:
    assert _plan(["--include", "localhost:0,1", "t.py"]).nproc == 2
    assert _plan(["--include", "thishost:1,3", "t.py"]).nproc == 2
    with pytest.raises(LaunchError, match="Cannot specify num_nodes/gpus"):
        _plan(["--include", "localhost:0", "--num_gpus", "2", "t.py"])


def test_plan_cuda_maps_slots_to_visible_devices() -> None:
    job = _plan(["--include", "localhost:1,3", "t.py"], cuda=["4", "5", "6", "7"])
    assert job.nproc == 2 and job.rank_env["CUDA_VISIBLE_DEVICES"] == "5,7"
    assert _plan(["t.py"], cuda=["0", "1"]).nproc == 2
    with pytest.raises(LaunchError, match="--num_gpus 3 .* has \\(2\\)"):
        _plan(["--num_gpus", "3", "t.py"], cuda=["0", "1"])


def test_plan_user_omp_threads_and_core_binding() -> None:
    job = _plan(["--num_gpus", "2", "t.py"], cores=[0, 1, 2, 3], environ={"OMP_NUM_THREADS": "5"})
    assert "OMP_NUM_THREADS" not in job.rank_env and job.user_env == {"OMP_NUM_THREADS"}  # theirs reaches the ranks
    bound = _plan(["--num_gpus", "2", "--bind_cores_to_rank", "t.py"], cores=[0, 1, 2, 3, 4])
    assert bound.cores == [(0, 1), (2, 3)] and bound.rank_env["OMP_NUM_THREADS"] == "2"
    listed = _plan(["--num_gpus", "2", "--bind_cores_to_rank", "--bind_core_list", "1,3", "t.py"],
                   cores=[0, 1, 2, 3])
    assert listed.cores == [(1,), (3,)]
    with pytest.raises(LaunchError, match="cores \\[9\\]"):
        _plan(["--num_gpus", "1", "--bind_cores_to_rank", "--bind_core_list", "9", "t.py"])


def test_plan_single_node_from_hostfile_and_multi_node_selection() -> None:
    with pytest.raises(LaunchError, match="spans 2 nodes \\(w0, w1\\): a multi-node launch"):
        _plan(["t.py"], hostfile={"w0": 2, "w1": 2})
    assert _plan(["--num_nodes", "1", "t.py"], hostfile={"w0": 2, "w1": 2}).nproc == 2
    one = _plan(["-i", "w1:1", "t.py"], hostfile={"w0": 2, "w1": 2}, cuda=["0", "1"])
    assert one.nproc == 1 and one.rank_env["CUDA_VISIBLE_DEVICES"] == "1"
    assert _plan(["t.py"], hostfile={"localhost": 3}).nproc == 3
    with pytest.raises(LaunchError, match="--force_multi"):
        _plan(["--force_multi", "t.py"], hostfile={"localhost": 3})
    with pytest.raises(LaunchError, match="needs a hostfile"):
        _plan(["--num_nodes", "2", "t.py"])
    args = parse_args(["-e", "w0:1@w2", "t.py"])
    assert select_nodes(args, {"w0": 2, "w1": 1, "w2": 4}, None, NAMES) == {"w0": [0], "w1": [0]}


def _mode(argv: list[str], hosts: dict[str, int], pdsh: bool = False) -> str:
    args = parse_args([*argv, "t.py"])
    return launch_mode(args, select_nodes(args, hosts, None, NAMES), pdsh)


def test_launch_mode() -> None:
    two = {"w0": 2, "w1": 2}
    assert _mode([], {"w0": 2}) == "local"
    assert _mode(["--no_ssh", "--node_rank", "0"], {"w0": 2}) == "local"
    assert _mode(["--num_nodes", "1"], two) == "local"
    assert _mode([], two) == "ssh" and _mode([], two, pdsh=True) == "pdsh"
    assert _mode(["--launcher", "ssh"], two, pdsh=True) == "ssh"
    assert _mode(["--force_multi"], {"w0": 2}) == "ssh"
    for launcher in ("openmpi", "mpich", "impi", "mvapich", "slurm"):
        assert _mode(["--launcher", launcher], two) == launcher
    assert _mode(["--launcher", "slurm"], {"w0": 2}) == "local"  # one node: DeepSpeed runs it locally
    assert _mode(["--no_ssh", "--node_rank", "1"], two) == "no_ssh"
    with pytest.raises(LaunchError, match="--no_ssh needs --node_rank N.*2 nodes \\(w0, w1\\), numbered 0..1"):
        _mode(["--no_ssh"], two)
    with pytest.raises(LaunchError, match="--node_rank 1 only applies with --no_ssh"):
        _mode(["--node_rank", "1"], two)
    with pytest.raises(LaunchError, match="--node_rank 1 with a one-node selection"):
        _mode(["--no_ssh", "--node_rank", "1"], {"w0": 2})
    with pytest.raises(LaunchError, match="--max_restarts -2 must be >= 0"):
        _mode(["--max_restarts", "-2"], two)
    with pytest.raises(SystemExit):
        parse_args(["--launcher", "mpi", "t.py"])  # not a runner: argparse names the choices


def test_plan_module_no_local_rank_and_unsupported_flags() -> None:
    assert _plan(["--module", "--no_local_rank", "pkg.train", "--x"]).argv == [sys.executable, "-u", "-m", "pkg.train",
                                                                                "--x"]
    with pytest.raises(LaunchError, match="--autotuning"):
        _plan(["--autotuning", "tune", "t.py"])
    with pytest.raises(LaunchError, match="apply with --elastic_training"):
        _plan(["--min_elastic_nodes", "2", "t.py"])
    from deepshard.launcher.node import elastic_range

    assert elastic_range(parse_args(["--elastic_training", "t.py"]), 3) == (1, 3)
    assert elastic_range(parse_args(["--elastic_training", "--min_elastic_nodes", "2", "t.py"]), 3) == (2, 3)
    assert elastic_range(parse_args(["t.py"]), 3) is None
    with pytest.raises(LaunchError, match="need 1 <= min <= max"):
        elastic_range(parse_args(["--elastic_training", "--min_elastic_nodes", "3", "--max_elastic_nodes", "2",
                                  "t.py"]), 3)
    with pytest.raises(LaunchError, match="--module and --no_python"):
        _plan(["--module", "--no_python", "t.py"])


# ------------------------------------------------------------------------------ init_distributed env


def test_resolve_no_env_is_world_of_one() -> None:
    assert resolve_dist_env({}) == DistEnv(0, 1, 0, None, 29500, "none")
    assert resolve_dist_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"},
                            auto_mpi_discovery=False).source == "none"


def test_resolve_launcher_and_torchrun_env() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234", "OMPI_COMM_WORLD_RANK": "0"}
    assert resolve_dist_env(env) == DistEnv(3, 4, 1, "10.0.0.5", 1234, "env")
    minimal = resolve_dist_env({"RANK": "1", "WORLD_SIZE": "2"}, distributed_port=5555)
    assert minimal == DistEnv(1, 2, 1, "127.0.0.1", 5555, "env")


def test_resolve_explicit_args_win() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "MASTER_ADDR": "h"}
    assert resolve_dist_env(env, rank=1, world_size=2) == DistEnv(1, 2, 3, "h", 29500, "args")
    assert resolve_dist_env({}, rank=1, world_size=3) == DistEnv(1, 3, 1, "127.0.0.1", 29500, "args")
    with pytest.raises(ValueError, match="rank 2 is out of range for world size 2"):
        resolve_dist_env({}, rank=2, world_size=2)
    with pytest.raises(ValueError, match="pass both"):
        resolve_dist_env({}, rank=1)


def test_resolve_openmpi_and_mpich() -> None:
    ompi = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": "node0"}
    assert resolve_dist_env(ompi) == DistEnv(5, 8, 1, "node0", 29500, "openmpi")
    single = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
              "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert resolve_dist_env(single).master_addr == "127.0.0.1"
    with pytest.raises(ValueError, match="world size 8 .* MASTER_ADDR is not set"):
        resolve_dist_env({k: v for k, v in ompi.items() if k != "MASTER_ADDR"})
    mpich = {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3"}
    assert resolve_dist_env(mpich) == DistEnv(2, 3, 2, "127.0.0.1", 29500, "mpich")


def test_resolve_slurm() -> None:
    slurm = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_JOB_NUM_NODES": "2",
             "SLURM_JOB_NODELIST": "gpu[007-008]", "SLURM_LAUNCH_NODE_IPADDR": "10.1.1.1"}
    assert resolve_dist_env(slurm) == DistEnv(6, 8, 2, "gpu007", 29500, "slurm")
    no_list = {k: v for k, v in slurm.items() if k != "SLURM_JOB_NODELIST"}
    assert resolve_dist_env(no_list).master_addr == "10.1.1.1"
    bare = {k: v for k, v in no_list.items() if k != "SLURM_LAUNCH_NODE_IPADDR"}
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        resolve_dist_env(bare)
    assert resolve_dist_env({**bare, "MASTER_ADDR": "m"}).master_addr == "m"
    one_node = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_NNODES": "1"}
    assert resolve_dist_env(one_node) == DistEnv(1, 2, 1, "127.0.0.1", 29500, "slurm")


def test_first_host_of_nodelist() -> None:
    assert _first_host("node1,node2") == "node1"
    assert _first_host("gpu[03-05,9],cpu1") == "gpu03"
    assert _first_host("n[1-2]-ib") == "n1-ib"
    assert _first_host("rack[1-2]-n[1-4]") is None


def test_default_timeout() -> None:
    assert default_timeout({}) == datetime.timedelta(minutes=10)
    assert default_timeout({"DEEPSPEED_TIMEOUT": "30"}) == datetime.timedelta(minutes=30)
    assert default_timeout({"DEEPSPEED_TIMEOUT": "30", "DEEPSHARD_TIMEOUT": "2.5"}) == \
        datetime.timedelta(minutes=2.5)
    with pytest.raises(ValueError, match="DEEPSHARD_TIMEOUT='soon'"):
        default_timeout({"DEEPSHARD_TIMEOUT": "soon"})


def test_output_forwarding_splits_after_last_line_end() -> None:
    from deepshard.launcher.output import _split_complete

    assert _split_complete(b"a\nb") == (b"a\n", b"b")
    assert _split_complete(b"\r 50%|##  |\r 60%") == (b"\r 50%|##  |\r", b" 60%")
    assert _split_complete(b"partial") == (b"", b"partial")


def test_plan_rejects_non_positive_counts() -> None:
    with pytest.raises(LaunchError, match="--num_gpus 0 must be >= 1"):
        _plan(["--num_gpus", "0", "t.py"])
    with pytest.raises(LaunchError, match="--num_nodes 0 must be >= 1"):
        _plan(["--num_nodes", "0", "t.py"])
    assert _plan(["--num_nodes", "1", "--num_gpus", "2", "t.py"]).nproc == 2


def test_gloo_interface_is_the_route_to_master() -> None:
    import psutil

    from deepshard.distributed import gloo_interface_for

    assert gloo_interface_for("127.0.0.1") is None and gloo_interface_for("localhost") is None
    own = [(name, a.address) for name, addrs in psutil.net_if_addrs().items() for a in addrs
           if a.family == socket.AF_INET and not a.address.startswith("127.")]
    if own:  # this machine's own address is reached through its own interface (no packet is sent)
        name, address = own[0]
        assert gloo_interface_for(address) == name


def test_gloo_interface_set_only_when_gloo_would_fall_back_to_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    import deepshard.distributed as distributed

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # records the original state, restored afterwards
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setattr(distributed, "gloo_interface_for", lambda addr: f"if-to-{addr}")
    usable = [False]
    monkeypatch.setattr(distributed, "hostname_is_usable", lambda hostname=None: usable[0])
    multi = DistEnv(1, 4, 0, "10.0.0.1", 29500, "env")
    for env, backend in [(multi, "nccl"), (DistEnv(0, 1, 0, "10.0.0.1", 1, "env"), "gloo"),
                         (DistEnv(1, 4, 0, "127.0.0.1", 1, "env"), "gloo")]:
        distributed._choose_gloo_interface(env, backend)
        assert "GLOO_SOCKET_IFNAME" not in os.environ
    usable[0] = True
    distributed._choose_gloo_interface(multi, "gloo")
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # gloo finds its address by itself
    usable[0] = False
    distributed._choose_gloo_interface(multi, "gloo")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "if-to-10.0.0.1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine")
    distributed._choose_gloo_interface(multi, "gloo")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "mine"


def test_a_routed_script_gets_local_rank_right_after_its_path(tmp_path: Path) -> None:
    """The launcher starts ``deepshard.compat.run --local_rank=N [flags] script args``; the script sees
    ``[script, --local_rank=N, args]``, DeepSpeed's order."""
    from deepshard.compat.run import main as run_main
    from deepshard.compat.run import KEEP_DEEPSPEED

    script, seen = tmp_path / "s.py", tmp_path / "argv.json"
    script.write_text(f"import json, sys\njson.dump(sys.argv, open({str(seen)!r}, 'w'))\n")
    saved = list(sys.argv)
    try:
        run_main(["--local_rank=3", KEEP_DEEPSPEED, str(script), "--lr", "1"])
    finally:
        sys.argv = saved
    assert json.loads(seen.read_text()) == [str(script), "--local_rank=3", "--lr", "1"]
