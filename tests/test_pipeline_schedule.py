"""The pipeline schedule the torch engine runs (``tensoropt.space.pipeline_schedule``): each device's order of
forwards and backwards (1F1B, interleaved 1F1B as Megatron-LM orders it), the boundaries where messages pass, that
devices following it cannot wait for each other forever, and the closed forms the cost model prices it with."""

import numpy as np
import pytest

from tensoropt.cost.pipeline_memory import held_messages as priced_held_messages
from tensoropt.cost.pipeline_memory import in_flight, in_flight_last, relayed_in_flight
from tensoropt.space.pipeline_schedule import (
    ACTIVATION,
    BACKWARD,
    FORWARD,
    Action,
    Boundary,
    check,
    compute_order,
    device_steps,
    held_messages,
    simulate,
    stage_device,
)

# (pp, v, micro-batches): 1F1B with more and fewer micro-batches than stages, interleaved with one and more rounds
CASES = [(2, 1, 4), (4, 1, 2), (4, 1, 9), (3, 1, 3), (2, 2, 2), (2, 2, 8), (4, 2, 8), (3, 3, 6), (4, 4, 4),
         (8, 2, 16), (6, 3, 18)]


def _in_flight_chunks(order) -> int:
    held = most = 0
    for action in order:
        held += 1 if action.kind == FORWARD else -1
        most = max(most, held)
    return most


@pytest.mark.parametrize("pp, v, m", CASES)
def test_every_device_runs_each_of_its_stages_forward_and_backward_once_a_micro_batch(pp, v, m):
    for rank in range(pp):
        order = compute_order(rank, pp, v, m)
        mine = [rank + k * pp for k in range(v)]
        assert sorted(order) == sorted(Action(kind, s, mb) for kind in (FORWARD, BACKWARD) for s in mine
                                       for mb in range(m))
        # each micro-batch's backward after its forward, and never more in flight than the schedule's warm-up + 1
        done = set()
        for action in order:
            if action.kind == BACKWARD:
                assert Action(FORWARD, action.stage, action.micro_batch) in done
            done.add(action)


def test_interleaved_order_is_megatrons():
    """pp 2, v 2, 4 micro-batches, device 0 (stages 0 and 2): 2 (p - 1) + (v - 1) p = 4 warm-up forwards walking the
    chunks in groups of p micro-batches, then one forward and one backward at a time, backwards from the last chunk."""
    order = [(a.kind, a.stage, a.micro_batch) for a in compute_order(0, 2, 2, 4)]
    assert order == [("F", 0, 0), ("F", 0, 1), ("F", 2, 0), ("F", 2, 1),
                     ("F", 0, 2), ("B", 2, 0), ("F", 0, 3), ("B", 2, 1), ("F", 2, 2), ("B", 0, 0),
                     ("F", 2, 3), ("B", 0, 1),
                     ("B", 2, 2), ("B", 2, 3), ("B", 0, 2), ("B", 0, 3)]


@pytest.mark.parametrize("pp, v, m", CASES)
def test_the_simulated_clock_adds_no_bubble(pp, v, m):
    """A forward one unit, a backward two: the step ends when the last device's last backward does, after the
    (m v + p - 1) rounds of 1F1B (Narayanan et al. 2021: the bubble (p - 1) / (v m) of the ideal step)."""
    _, finish = simulate(pp, v, m)
    if m >= pp:
        assert max(finish.values()) == 3 * (m * v + pp - 1)
    assert max(finish.values()) >= 3 * (m * v + pp - 1)


@pytest.mark.parametrize("pp, v, m", CASES)
def test_both_ends_of_a_message_meet_at_one_boundary_in_one_order(pp, v, m):
    """Between two devices the messages one sends at a boundary are those the other receives there, in the same
    order (NCCL matches point-to-point messages in order), each received before the compute that reads it."""
    steps = {r: device_steps(r, pp, v, m) for r in range(pp)}
    at = {r: {s.time: s for s in steps[r] if isinstance(s, Boundary)} for r in range(pp)}
    for r in range(pp):
        for boundary in at[r].values():
            for peer in range(pp):
                sent = [msg for msg in boundary.sends if stage_device(msg.to_stage, pp) == peer]
                if sent:
                    other = at[peer][boundary.time]
                    assert [msg for msg in other.receives if stage_device(msg.stage, pp) == r] == sent
        received = set()
        for step in steps[r]:
            if isinstance(step, Boundary):
                received.update(step.receives)
            elif step.kind == FORWARD and step.stage % (pp * v) != 0:
                assert any(msg.what == ACTIVATION and msg.to_stage == step.stage and msg.micro_batch == step.micro_batch
                           for msg in received)


@pytest.mark.parametrize("pp, v, m", CASES)
def test_devices_that_wait_at_their_boundaries_never_wait_forever(pp, v, m):
    """Each device walks its steps; a boundary is passed once every device it exchanges messages with has reached it
    (all of them post, then wait). Run so, one step at a time, every device reaches its end."""
    steps = {r: device_steps(r, pp, v, m) for r in range(pp)}
    position, reached = dict.fromkeys(range(pp), 0), {r: set() for r in range(pp)}

    def peers(boundary: Boundary) -> set[int]:
        return {stage_device(msg.to_stage, pp) for msg in boundary.sends} | \
            {stage_device(msg.stage, pp) for msg in boundary.receives}
    moved = True
    while moved:
        moved = False
        for r in range(pp):
            if position[r] == len(steps[r]):
                continue
            step = steps[r][position[r]]
            if isinstance(step, Boundary):
                reached[r].add(step.time)
                if not all(step.time in reached[p] for p in peers(step)):
                    continue
            position[r] += 1
            moved = True
    assert all(position[r] == len(steps[r]) for r in range(pp))


def test_a_schedule_the_runtime_cannot_run_is_refused():
    with pytest.raises(ValueError, match="multiple of pp"):
        check(4, 2, 6)
    with pytest.raises(ValueError, match="pp >= 2"):
        check(1, 1, 4)


def test_the_cost_models_closed_forms_are_the_schedules_counts():
    """What device 0 and the last device keep in flight (activations of chunks forwarded, not yet backwarded) and the
    messages they hold early, priced by closed forms (``cost.pipeline_memory``), equal the schedule's own counts on
    every p up to 16, v up to 4 and m up to 3 rounds (1F1B: every m up to 3 p)."""
    for pp in range(2, 17):
        for v in (1, 2, 3, 4):
            for m in (range(1, 3 * pp + 1) if v == 1 else range(pp, 3 * pp + 1, pp)):
                first, last = compute_order(0, pp, v, m), compute_order(pp - 1, pp, v, m)
                assert float(in_flight(np.array(pp), m, np.array(v))) == _in_flight_chunks(first) / v, (pp, v, m)
                assert float(in_flight_last(pp, m, v)) == pytest.approx(_in_flight_chunks(last) / v), (pp, v, m)
                counted = [held_messages(r, pp, v, m) for r in (0, pp - 1)]
                priced = priced_held_messages(pp, v, m)
                assert [c.activations + c.gradients for c in counted] == [int(p) for p in priced], (pp, v, m)


def _received_chunks(order) -> int:
    """The most chunks in flight at once that are not stage 0 (each holds the values it received beside the
    stream: the attention mask, rotary tables)."""
    live: set[tuple[int, int]] = set()
    most = 0
    for action in order:
        if action.kind == FORWARD:
            live.add((action.stage, action.micro_batch))
            most = max(most, sum(1 for stage, _ in live if stage != 0))
        else:
            live.discard((action.stage, action.micro_batch))
    return most


def test_the_relayed_inputs_priced_are_the_schedules_received_chunks():
    """Device 0 and the last device hold a stage's received side inputs once per chunk in flight that is not stage 0
    (``cost.pipeline_memory.relayed_in_flight``): the closed form equals the schedule's count on every p up to 8, v
    up to 12 (GPT-3's and Nemotron-4's published recipes interleave 12) and m up to 8 rounds. Simulated at full size
    (benchmarks/_memory_recipes.py), GPT-3 175B's first device held 40 received masks at v 6 and 88 at v 12, as
    this gives."""
    for pp in range(2, 9):
        for v in range(1, 13):
            for m in (pp, 2 * pp, 3 * pp, 8 * pp):
                first, last = relayed_in_flight(pp, m, v)
                assert int(first) == _received_chunks(compute_order(0, pp, v, m)), (pp, v, m)
                assert int(last) == _received_chunks(compute_order(pp - 1, pp, v, m)), (pp, v, m)
    assert [int(relayed_in_flight(8, 64, v)[0]) for v in (6, 12)] == [40, 88]
    assert [int(n) for n in relayed_in_flight(1, 4, 1)] == [0, 0]


def test_held_messages_do_not_grow_with_the_micro_batches():
    """The reason for the executor: torch's stages held (2v - 1) m messages; here the count settles after two
    rounds of micro-batches, whatever m."""
    for pp, v in ((4, 2), (8, 2), (6, 3)):
        assert len({held_messages(pp - 1, pp, v, k * pp) for k in range(2, 7)}) == 1
        assert len({held_messages(0, pp, v, k * pp) for k in range(2, 7)}) == 1
