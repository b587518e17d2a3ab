"""The pipeline schedule the torch engine runs: which forward and backward each device computes in which order, and
where each stage-to-stage message is sent and received. Pure data (no torch): the runtime executes it
(``runtime.pipeline.executor``) and the cost model prices what it holds (``cost.pipeline_memory``), so both read
one schedule.

Order of compute (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters", sec.
2.2): device ``r`` of ``p`` holds stages ``r, r + p, ...`` (``v`` of them, its model chunks). With ``v = 1`` it
runs 1F1B: ``min(p - r - 1, m)`` warm-up forwards, then alternately one forward and one backward, then the
remaining backwards (fewer micro-batches than stages is GPipe's order, all forwards first). With ``v > 1``
(interleaved 1F1B, ``m`` a multiple of ``p``) the device walks its chunks in groups of ``p`` micro-batches: the
``k``-th forward is chunk ``(k // p) % v`` of micro-batch ``(k // (p v)) p + k % p``, backwards the same with the
chunks reversed, after ``2 (p - r - 1) + (v - 1) p`` warm-up forwards (Megatron-LM's
``get_num_warmup_microbatches``), so device 0 holds about ``1 + (p - 1) / (p v)`` times 1F1B's activations.

Messages: each message is sent and received at one logical *boundary*. The schedule is simulated with a forward
taking one unit of time and a backward two; a forward (backward) finishing at time ``T`` sends its output
(its input's gradient) at boundary ``T``, and the device of the next (previous) stage receives it at that same
boundary. Every device goes through its boundaries in increasing order, posting all its sends and receives of
one boundary together and waiting for them before it goes on (synchronous point-to-point, as Megatron-LM's
schedules communicate), with its computes in between (a compute starting at ``T`` after boundary ``T``). No
device can wait forever: the messages of boundary ``T`` are posted by both ends at ``T``, and every device
reaches ``T`` once all earlier boundaries are done. Within a boundary the messages between two devices are
posted in one sorted order on both sides, as NCCL, which matches point-to-point messages in order and has no
tags, needs.

What a device holds for messages follows from this: a send is complete when its boundary is, so no sent tensor
stays referenced; a received activation lies in its buffer from its boundary until its forward reads it (then
it is the stage's input, an activation like any other), a received gradient until its backward has run.
``held_messages`` counts the most of them a device holds at once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

FORWARD, BACKWARD = "F", "B"
ACTIVATION, GRADIENT = "activation", "gradient"
DURATION = {FORWARD: 1, BACKWARD: 2}        # the simulated clock's units (a backward about twice a forward)


@dataclass(frozen=True, order=True)
class Action:
    """One stage's forward or backward of one micro-batch."""

    kind: str               # FORWARD or BACKWARD
    stage: int              # among all pp * v stages
    micro_batch: int


@dataclass(frozen=True, order=True)
class Message:
    """A stage's output (``ACTIVATION``, to ``stage + 1``) or its input's gradient (``GRADIENT``, to ``stage - 1``)
    for one micro-batch, sent by ``stage``."""

    what: str
    stage: int              # the sending stage
    micro_batch: int

    @property
    def to_stage(self) -> int:
        return self.stage + 1 if self.what == ACTIVATION else self.stage - 1


@dataclass(frozen=True)
class Boundary:
    """The messages one device sends and receives at one boundary (both sorted as every device sorts them)."""

    time: int
    sends: tuple[Message, ...]
    receives: tuple[Message, ...]


Step = Action | Boundary


def stage_device(stage: int, pp: int) -> int:
    return stage % pp


def warmup_forwards(rank: int, pp: int, virtual: int, micro_batches: int) -> int:
    """Forwards device ``rank`` runs before its first backward (module doc)."""
    total = micro_batches * virtual
    if virtual == 1:
        return min(pp - rank - 1, micro_batches)
    return min(2 * (pp - rank - 1) + (virtual - 1) * pp, total)


def compute_order(rank: int, pp: int, virtual: int, micro_batches: int) -> tuple[Action, ...]:
    """The forwards and backwards device ``rank`` runs, in order (module doc)."""
    check(pp, virtual, micro_batches)
    total = micro_batches * virtual

    def chunk_of(k: int, forward: bool) -> Action:
        group, within = divmod(k, pp * virtual)
        chunk = (within // pp) if virtual > 1 else 0
        if not forward:
            chunk = virtual - 1 - chunk
        mb = group * pp + within % pp if virtual > 1 else k
        return Action(FORWARD if forward else BACKWARD, chunk * pp + rank, mb)
    warmup = warmup_forwards(rank, pp, virtual, micro_batches)
    order = [chunk_of(k, True) for k in range(warmup)]
    for k in range(total - warmup):
        order += [chunk_of(warmup + k, True), chunk_of(k, False)]
    order += [chunk_of(k, False) for k in range(total - warmup, total)]
    return tuple(order)


def check(pp: int, virtual: int, micro_batches: int) -> None:
    if pp < 2 or virtual < 1 or micro_batches < 1:
        raise ValueError(f"a pipeline needs pp >= 2, virtual stages >= 1 and micro-batches >= 1, got pp {pp}, "
                         f"virtual stages {virtual}, {micro_batches} micro-batches")
    if virtual > 1 and micro_batches % pp:
        raise ValueError(f"interleaved 1F1B runs micro-batches in groups of pp: {micro_batches} micro-batches is not "
                         f"a multiple of pp {pp}")


def _dependencies(action: Action, stages: int) -> list[Action]:
    if action.kind == FORWARD:
        return [Action(FORWARD, action.stage - 1, action.micro_batch)] if action.stage > 0 else []
    if action.stage == stages - 1:
        return [Action(FORWARD, action.stage, action.micro_batch)]
    return [Action(BACKWARD, action.stage + 1, action.micro_batch)]


@functools.lru_cache(maxsize=64)
def simulate(pp: int, virtual: int, micro_batches: int) -> tuple[dict[Action, int], dict[Action, int]]:
    """(start time, finish time) of every action on the simulated clock (module doc): each device starts its next
    action as soon as it is free and the action's inputs have arrived."""
    stages = pp * virtual
    orders = [compute_order(r, pp, virtual, micro_batches) for r in range(pp)]
    start: dict[Action, int] = {}
    finish: dict[Action, int] = {}
    position, free_at, time = [0] * pp, [0] * pp, 0
    remaining = sum(map(len, orders))
    while remaining:
        for rank, order in enumerate(orders):
            if position[rank] == len(order) or free_at[rank] > time:
                continue
            action = order[position[rank]]
            if all(finish.get(d, time + 1) <= time for d in _dependencies(action, stages)):
                start[action], finish[action] = time, time + DURATION[action.kind]
                free_at[rank], position[rank], remaining = finish[action], position[rank] + 1, remaining - 1
        later = [t for t in free_at if t > time]
        if remaining and not later:         # every device idle, each waiting for an action nobody will run
            waiting = [order[position[r]] for r, order in enumerate(orders) if position[r] < len(order)]
            raise AssertionError(f"pipeline schedule pp {pp} v {virtual} m {micro_batches} deadlocks at {waiting}")
        time = min(later, default=time)
    return start, finish


def _messages(pp: int, virtual: int, micro_batches: int) -> dict[Message, int]:
    """{message: its boundary}: every output of a stage but the last, every input gradient of a stage but the
    first, sent when its action finishes."""
    stages = pp * virtual
    _, finish = simulate(pp, virtual, micro_batches)
    out = {}
    for action, time in finish.items():
        if action.kind == FORWARD and action.stage < stages - 1:
            out[Message(ACTIVATION, action.stage, action.micro_batch)] = time
        elif action.kind == BACKWARD and action.stage > 0:
            out[Message(GRADIENT, action.stage, action.micro_batch)] = time
    return out


@functools.lru_cache(maxsize=64)
def device_steps(rank: int, pp: int, virtual: int, micro_batches: int) -> tuple[Step, ...]:
    """What device ``rank`` does, in order: its computes and its boundaries (module doc). A boundary where it
    neither sends nor receives is left out."""
    start, _ = simulate(pp, virtual, micro_batches)
    boundaries: dict[int, tuple[list[Message], list[Message]]] = {}
    for message, time in _messages(pp, virtual, micro_batches).items():
        sends, receives = boundaries.setdefault(time, ([], []))
        if stage_device(message.stage, pp) == rank:
            sends.append(message)
        if stage_device(message.to_stage, pp) == rank:
            receives.append(message)
    timed: list[tuple[int, int, Step]] = [(t, 0, Boundary(t, tuple(sorted(s)), tuple(sorted(r))))
                                          for t, (s, r) in boundaries.items() if s or r]
    timed += [(start[a], 1, a) for a in compute_order(rank, pp, virtual, micro_batches)]
    return tuple(step for _, _, step in sorted(timed, key=lambda x: (x[0], x[1])))


@dataclass(frozen=True)
class HeldMessages:
    """The most received messages device ``rank`` holds at once beside its stages' activations (module doc), at any
    compute of its step: activations arrived before their forward, gradients arrived and not yet used."""

    activations: int
    gradients: int


def held_messages(rank: int, pp: int, virtual: int, micro_batches: int) -> HeldMessages:
    """At each compute of the device: the activations received for later forwards, and the gradients received for
    later backwards (the one a backward reads is its working set, ``cost.pipeline_memory`` counts it there); the
    most of each over the step, each counted at its own worst moment (so a bound on both together)."""
    pending_acts: set[Message] = set()
    pending_grads: set[Message] = set()
    most_acts = most_grads = 0
    for step in device_steps(rank, pp, virtual, micro_batches):
        if isinstance(step, Boundary):
            pending_acts.update(m for m in step.receives if m.what == ACTIVATION)
            pending_grads.update(m for m in step.receives if m.what == GRADIENT)
            continue
        if step.kind == FORWARD:
            pending_acts.discard(Message(ACTIVATION, step.stage - 1, step.micro_batch))
        else:
            pending_grads.discard(Message(GRADIENT, step.stage + 1, step.micro_batch))
        most_acts, most_grads = max(most_acts, len(pending_acts)), max(most_grads, len(pending_grads))
    return HeldMessages(most_acts, most_grads)


__all__ = ["ACTIVATION", "Action", "BACKWARD", "Boundary", "FORWARD", "GRADIENT", "HeldMessages", "Message", "Step",
           "check", "compute_order", "device_steps", "held_messages", "simulate", "stage_device", "warmup_forwards"]
