"""DeepSpeed's module-level ``deepspeed.comm`` functions (``deepshard.comm``) on a gloo world of 2:
results against closed forms, and every call counted by the comms logger."""
from __future__ import annotations

from tests.multiproc.harness import run_world
from tests.multiproc.scenarios_comm_api import comm_api_rest_world, comm_api_world


def test_comm_module_functions_and_their_counts() -> None:
    world = 2
    results = run_world(comm_api_world, world)
    for rank, res in enumerate(results):
        assert (res["rank"], res["world"], res["local_rank"]) == (rank, world, rank)
        assert res["initialized"] and res["backend"] == "gloo"
        assert res["sum"] == [3.0] * 4  # 1 + 2
        assert res["max"] == world - 1
        assert res["bcast"] == [float(world - 1)] * 3
        assert res["gathered"] == [v for r in range(world) for v in (float(r), 10.0 * r)]
        # sum over ranks r of (arange(4) + r) = 2 * arange(4) + 1; rank r keeps elements [2r, 2r + 2)
        assert res["scattered"] == [2.0 * i + 1.0 for i in (2 * rank, 2 * rank + 1)]
        assert res["list_gathered"] == [float(r * r) for r in range(world)]
        assert res["counts"] == {"all_reduce": (2, 5), "broadcast": (1, 3), "all_gather": (2, 2 * world + world),
                                 "reduce_scatter": (1, 2 * world), "barrier": (1, 0)}
        assert res["in_summary"]
        assert res["device"] == ("cpu", "cpu", "gloo")


def test_the_rest_of_deepspeed_comm_against_torch() -> None:
    """all_gather_object, the coalesced and batched collectives and the helpers DeepSpeed 0.19.8's
    deepspeed.comm has besides the common collectives, on 2 gloo processes, each equal to torch's own call."""
    world = 2
    for rank, res in enumerate(run_world(comm_api_rest_world, world)):
        ours, theirs = res["objects"]
        assert ours == theirs == [{"rank": r, "tag": "r" * (r + 1)} for r in range(world)]
        outs, refs, waited = res["gather_coalesced"]
        assert outs == refs and waited is True
        assert refs[1] == [v + 10.0 * r for r in range(world) for v in (0.0, 1.0, 2.0)]
        mine, ref = res["reduce_coalesced"]
        assert mine == ref == [[3.0, 3.0], [2.0, 2.0, 2.0]]
        recv, ref_recv = res["p2p"]
        assert recv == ref_recv == [float((rank - 1) % world)] * 3
        assert res["group_ranks"] == ([0, 1], [1], [1])
        assert res["has"] == (True, True, True, True)
        assert res["launcher"] == (rank, rank, world)
        assert res["log"] == (False, True, 2, ["all_reduce", "barrier"])
        assert res["mesh"] == ((world,), ("dp",))
        assert res["backend"] == ("torch", True, world)
