"""``deepspeed.runtime.pipe.schedule`` on deepshard (DeepSpeed's instruction classes over deepshard's
schedules-as-data, deepshard.pipe.instructions): every tick of every schedule equals DeepSpeed 0.19.8's."""
from __future__ import annotations

from tests.deepspeed_compat.pipe_schedules import dump
from tests.deepspeed_compat.real import needs_deepspeed, run_deepspeed
from tests.unit.conftest import shim  # noqa: F401 - the fixture


@needs_deepspeed
def test_every_tick_equals_deepspeeds(shim: None) -> None:  # noqa: F811
    import deepspeed.runtime.pipe.schedule as schedule

    code = ("import deepspeed.runtime.pipe.schedule as s\nfrom tests.deepspeed_compat.pipe_schedules import dump\n"
            "print('=====')\nprint('\\n'.join(dump(s)))")
    theirs = run_deepspeed(code).split("=====\n", 1)[1].splitlines()
    ours = dump(schedule)
    assert len(ours) == len(theirs) == 150
    assert [a for a, b in zip(ours, theirs) if a != b] == []


def test_instructions_are_views_of_deepshards_actions(shim: None) -> None:  # noqa: F811
    """The train schedule's computes, sends and receives are the 1f1b action list's, in its order."""
    import deepspeed.runtime.pipe.schedule as schedule

    from deepshard.pipe.schedule import Kind, rank_schedule

    names = {Kind.FORWARD: "ForwardPass", Kind.BACKWARD: "BackwardPass", Kind.SEND_ACT: "SendActivation",
             Kind.RECV_ACT: "RecvActivation", Kind.SEND_GRAD: "SendGrad", Kind.RECV_GRAD: "RecvGrad"}
    for stage in range(3):
        sched = schedule.TrainSchedule(micro_batches=5, stages=3, stage_id=stage)
        seen = [type(i).__name__ for cmds in sched for i in cmds if type(i).__name__ in names.values()]
        expected = [names[a.kind] for a in rank_schedule("1f1b", stage, 3, 5)]
        assert sorted(seen) == sorted(expected)
        computes = [n for n in seen if n.endswith("Pass")]
        assert computes == [n for n in expected if n.endswith("Pass")]
