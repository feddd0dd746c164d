"""``deepspeed.comm`` complete against DeepSpeed 0.19.8's public functions and classes: each one resolves on
deepshard.comm (its behaviour is checked against torch on 2 processes in tests/multiproc/test_comm_api.py),
and the list itself is read from the real DeepSpeed where it is installed, so it cannot drift."""
from __future__ import annotations

import pytest

from tests.deepspeed_compat.real import needs_deepspeed, run_deepspeed
from tests.unit.conftest import shim  # noqa: F401 - the fixture

# DeepSpeed 0.19.8's deepspeed.comm: its functions and classes, less the stdlib/typing names it imports
# (Any, Enum, timedelta) and the oneCCL backend class deepshard refuses (CCLBackend: no oneCCL here)
DS_COMM = """P2POp ProcessGroup ReduceOp TorchBackend CommsLogger GradBucket all_gather all_gather_coalesced
all_gather_into_tensor all_gather_object all_reduce all_reduce_coalesced all_to_all all_to_all_single allgather_fn
barrier batch_isend_irecv broadcast broadcast_object_list configure destroy_process_group enable_symm_mem_for_group
gather get_accelerator get_all_ranks_from_group get_caller_func get_comm_operation_count get_debug_log_name
get_default_args get_global_rank get_local_rank get_local_rank_from_launcher get_logged_comm_ops
get_msg_size_from_args get_rank get_tensor_kwarg get_tensor_position get_world_group get_world_rank_from_launcher
get_world_size get_world_size_from_launcher has_all_gather_into_tensor has_all_reduce_coalesced
has_coalescing_manager has_comm_data has_reduce_scatter_tensor in_aml in_aws_sm in_dlts inference_all_reduce
init_deepspeed_backend init_distributed initialize_mesh_device irecv is_available is_initialized isend log_summary
monitored_barrier mpi_discovery new_group patch_aml_env_for_torch_nccl_backend
patch_aws_sm_env_for_torch_nccl_backend recv reduce reduce_scatter reduce_scatter_fn reduce_scatter_tensor
reset_log scatter send set_backend timed_op""".split()
NOT_OURS = {"Any", "Enum", "timedelta", "CCLBackend"}


def test_every_deepspeed_comm_name_is_in_deepshard_comm(shim: None) -> None:
    import deepspeed.comm

    import deepshard.comm

    missing = [name for name in DS_COMM if not callable(getattr(deepshard.comm, name, None))]
    assert not missing, f"deepshard.comm lacks DeepSpeed's {missing}"
    assert all(getattr(deepspeed.comm, name) is getattr(deepshard.comm, name) for name in DS_COMM)
    with pytest.raises(AttributeError, match="oneCCL"):
        deepspeed.comm.CCLBackend  # noqa: B018 - the refusal is the point


def test_helpers_size_messages_as_deepspeed() -> None:
    """The logging helpers answer from a call's arguments (no process group needed)."""
    import torch

    from deepshard import comm

    def op(tensor, group=None, log_name="mine", prof=False):  # noqa: ANN001, ANN202
        return tensor

    assert comm.get_tensor_position(op) == 0 and comm.get_tensor_position(lambda x: x) == -1
    assert comm.get_default_args(op) == {"group": None, "log_name": "mine", "prof": False}
    assert comm.get_msg_size_from_args(op, torch.ones(3, 4)) == 48
    assert comm.get_msg_size_from_args(op, tensor=torch.ones(2, dtype=torch.float16)) == 4
    assert comm.get_msg_size_from_args(comm.batch_isend_irecv, [comm.P2POp(comm.isend, torch.ones(5), 1)]) == 20
    assert comm.get_debug_log_name({"log_name": "x"}, False) == "x"
    comm.reset_log()
    timed = comm.timed_op(op)
    assert timed(torch.ones(2)).tolist() == [1.0, 1.0]
    assert comm.get_logged_comm_ops() == ["mine"] and comm.get_comm_operation_count() == 1


def test_launcher_env_patches(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepshard import comm

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    assert (comm.get_local_rank_from_launcher(), comm.get_world_rank_from_launcher(),
            comm.get_world_size_from_launcher()) == (0, 0, 1)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    monkeypatch.setenv("AZ_BATCH_MASTER_NODE", "10.0.0.7:6000")
    assert comm.get_world_rank_from_launcher() == 3 and comm.get_world_size_from_launcher() == 4
    comm.patch_aml_env_for_torch_nccl_backend(verbose=False)
    import os

    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("3", "4", "1")
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.0.0.7", "6105")
    assert os.environ["NCCL_SOCKET_IFNAME"] == "^docker0,lo"
    assert not comm.in_aml() and not comm.in_dlts()
    monkeypatch.setenv("SM_TRAINING_ENV", "{}")
    assert comm.in_aws_sm()


@needs_deepspeed
def test_the_list_is_deepspeeds() -> None:
    code = ("import inspect, deepspeed.comm as c\n"
            "print(' '.join(sorted(n for n in dir(c) if not n.startswith('_') and "
            "(inspect.isfunction(getattr(c, n)) or inspect.isclass(getattr(c, n))))))")
    theirs = set(run_deepspeed(code).split())
    assert theirs - NOT_OURS == set(DS_COMM), (sorted(theirs - NOT_OURS - set(DS_COMM)),
                                               sorted(set(DS_COMM) - theirs))
