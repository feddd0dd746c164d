"""Pipeline schedules as data, run by the simulator with no process group: every schedule completes
(sends matched by receives in order, no deadlock, every pass once), and its step time (hence bubble) and
peak micro-batches in flight equal the formulas of REFERENCE_PARALLEL.md section 7."""
from __future__ import annotations

import itertools

import pytest

from deepshard.pipe.schedule import (Action, Costs, Kind, ScheduleError, build_schedule, one_f_one_b_order,
                                     PipeShape, schedule_name)
from deepshard.pipe.simulate import formula_makespan, formula_peak_in_flight, simulate

STAGES = [1, 2, 3, 4, 8]
MICRO = [1, 2, 3, 4, 8, 12, 16]
COSTS = [Costs(1, 1, 1), Costs(1, 2, 1), Costs(2, 1, 3)]


def _cases(name: str):
    for p, m in itertools.product(STAGES, MICRO):
        for v in ((2, 3) if name == "interleaved" else (1,)):
            if name == "interleaved" and m % p:
                continue
            yield p, m, v


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_step_time_and_in_flight_equal_the_formulas(name: str) -> None:
    for (p, m, v), costs in itertools.product(_cases(name), COSTS):
        result = simulate(build_schedule(name, p, m, v), m, v, costs)
        assert result.makespan == pytest.approx(formula_makespan(name, p, m, v, costs)), (name, p, m, v, costs)
        assert result.peak_in_flight == [formula_peak_in_flight(name, s, p, m, v) for s in range(p)]


def test_one_f_one_b_bubble_is_p_minus_1_over_m_plus_p_minus_1() -> None:
    for p, m in itertools.product(STAGES, MICRO):
        result = simulate(build_schedule("1f1b", p, m), m)
        assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


def test_unequal_stages_a_slower_last_stage_sets_the_pace() -> None:
    """Costs per rank: with the last stage slower in both passes, GPipe and 1F1B take m of its passes plus
    one of the first stage's (the fill and drain); its bubble is that one pass pair over the step."""
    fast, slow = Costs(1, 1, 1), Costs(2, 1.5, 1.5)
    for name, m in itertools.product(("gpipe", "1f1b"), MICRO):
        result = simulate(build_schedule(name, 2, m), m, costs=[fast, slow])
        assert result.makespan == pytest.approx(m * 5 + 3), (name, m)
        assert result.busy == [pytest.approx(m * 3), pytest.approx(m * 5)]
        assert result.stage_bubble(1) == pytest.approx(3 / (m * 5 + 3))
    with pytest.raises(ScheduleError, match="costs for 3 ranks given to a schedule of 2 ranks"):
        simulate(build_schedule("1f1b", 2, 4), 4, costs=[fast] * 3)


def test_replayed_durations_override_the_costs_pass_by_pass() -> None:
    """One slow pass (a measured run's jitter) holds up 1F1B's tight steady state on both stages: the
    stage that waits for it idles by the delay, and the step grows by it."""
    m = 4
    plain = simulate(build_schedule("1f1b", 2, m), m)
    slow = simulate(build_schedule("1f1b", 2, m), m, durations={(1, Kind.FORWARD, 1, 0): 1.5})
    assert slow.makespan == pytest.approx(plain.makespan + 0.5)
    assert slow.busy == [pytest.approx(plain.busy[0]), pytest.approx(plain.busy[1] + 0.5)]
    assert slow.stage_bubble(0) == pytest.approx(1 - plain.busy[0] / (plain.makespan + 0.5))


def test_interleaving_divides_the_bubble_by_the_chunk_count() -> None:
    p, m = 4, 8
    one = simulate(build_schedule("1f1b", p, m), m, costs=Costs(2, 2, 2))
    # the same per-rank work cut into v chunks: each chunk costs 1/v of a stage
    for v in (2, 4):
        inter = simulate(build_schedule("interleaved", p, m, v), m, v, Costs(2 / v, 2 / v, 2 / v))
        ideal = m * 6
        assert (inter.makespan - ideal) == pytest.approx((one.makespan - ideal) / v)


@pytest.mark.parametrize("costs", [Costs(1, 1, 1), Costs(1, 1, 0.5), Costs(2, 1, 1)])
def test_zero_bubble_h1_bubble_and_memory(costs: Costs) -> None:
    """ZB-H1 for m >= p: step time m(F+B) + (p-1)(F+B-2W) (B the full backward), a third of 1F1B's bubble
    when F = B_in = W; no stage holds more micro-batches than 1F1B's first stage (min(p, m))."""
    for p, m in itertools.product(STAGES, MICRO):
        if m < p:
            continue
        zb = build_schedule("zb-h1", p, m)
        # the order was list-scheduled with unit costs; the bound holds for these costs when F=B_in=W
        result = simulate(zb, m, costs=Costs(1, 1, 1))
        assert result.makespan == pytest.approx(formula_makespan("zb-h1", p, m))
        assert max(result.peak_in_flight) == min(p, m)
        assert result.peak_in_flight == [formula_peak_in_flight("zb-h1", s, p, m) for s in range(p)]
        one = simulate(build_schedule("1f1b", p, m), m)
        if p > 1:
            assert (result.makespan - 3 * m) == pytest.approx((one.makespan - 3 * m) / 3)
        # any cost model: still deadlock-free, and never slower than 1F1B under the same costs
        assert simulate(zb, m, costs=costs).makespan <= simulate(build_schedule("1f1b", p, m), m, costs=costs).makespan


def test_every_rank_list_has_its_passes_and_matching_messages() -> None:
    sched = build_schedule("1f1b", 3, 4)
    assert [str(a) for a in sched[2][:5]] == ["RECV_ACT0@1", "F0", "B0", "SEND_GRAD0@1", "RECV_ACT1@1"]
    assert [str(a) for a in sched[0][:4]] == ["F0", "SEND_ACT0@1", "F1", "SEND_ACT1@1"]
    sends = sum(a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD) for acts in sched for a in acts)
    recvs = sum(a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD) for acts in sched for a in acts)
    assert sends == recvs == 2 * 2 * 4  # 2 boundaries x (activation + gradient) x 4 micro-batches


def test_simulator_catches_out_of_order_receives() -> None:
    sched = build_schedule("gpipe", 2, 2)
    # stage 1 receives micro-batch 1 before micro-batch 0: the channel delivers 0 first
    recv = [i for i, a in enumerate(sched[1]) if a.kind is Kind.RECV_ACT]
    a0, a1 = sched[1][recv[0]], sched[1][recv[1]]
    sched[1][recv[0]], sched[1][recv[1]] = Action(Kind.RECV_ACT, 1, 0, 0), Action(Kind.RECV_ACT, 0, 0, 0)
    assert (a0.micro_batch, a1.micro_batch) == (0, 1)
    with pytest.raises(ScheduleError, match="out of order"):
        simulate(sched, 2)


def test_simulator_catches_a_deadlock() -> None:
    sched = build_schedule("1f1b", 2, 2)
    # stage 0 waits for a gradient before sending the activation that would produce it
    sched[0] = [a for a in sched[0] if a.kind is not Kind.SEND_ACT]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(sched, 2)


def test_simulator_catches_broken_dependencies() -> None:
    shape = PipeShape(1, 2)
    bad = [Action(Kind.BACKWARD, 0), Action(Kind.FORWARD, 0), Action(Kind.FORWARD, 1), Action(Kind.BACKWARD, 1)]
    with pytest.raises(ScheduleError, match="before its forward"):
        simulate([bad], 2)
    missing = one_f_one_b_order(shape, 0)[:-1]
    with pytest.raises(ScheduleError, match="never runs"):
        simulate([missing], 2)


def test_names_and_errors() -> None:
    assert schedule_name("One_F_One_B") == "1f1b"
    assert schedule_name("zero_bubble") == "zb-h1"
    with pytest.raises(ScheduleError, match="not a schedule"):
        build_schedule("pipedream", 2, 2)
    with pytest.raises(ScheduleError, match="multiple of the stage count"):
        build_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ScheduleError, match="one chunk per rank"):
        build_schedule("1f1b", 2, 2, chunks=2)
    with pytest.raises(ScheduleError, match="positive integer"):
        build_schedule("1f1b", 0, 2)
