"""torchrun as the launcher runs it: ``python -m launcher.torchrun ARGS`` is ``python -m torch.distributed.run ARGS``
(the same arguments, agent, rendezvous and workers), with one cost of its rendezvous removed.

torch's dynamic rendezvous (the c10d backend that ``--standalone`` and elastic runs use) names each event it records
after its caller, found with ``inspect.stack()`` (``dynamic_rendezvous.get_method_name``, torch 2.13): that builds
the source context of every frame of the stack, ~0.16 s a call on a 2-core CPU, twice per event, about ten events
a start and two at the end. With no event handler configured (torch's default) the events are then dropped; the
names alone cost ~1.5 s of CPU before the first worker started and ~0.5 s after the last one ended, in every launch
(measured with cProfile on torchrun; ``benchmarks/results/launch_overhead.md``). Here the caller's name is read
from its frame, which gives the same name (``sys._getframe`` at the same depth) without reading any source.
"""

from __future__ import annotations

import sys


def _method_name(depth: int = 2) -> str:
    """``dynamic_rendezvous.get_method_name``'s answer: the name of the function ``depth`` frames above this one
    (1: the caller, 2: the caller's caller, where torch's ``_record`` methods call it from)."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:                       # a stack shallower than depth
        return "no_method_name"


def main() -> None:
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    if callable(getattr(dynamic_rendezvous, "get_method_name", None)):   # a torch that still has it
        dynamic_rendezvous.get_method_name = _method_name
    from torch.distributed.run import main as torchrun_main
    torchrun_main()


if __name__ == "__main__":
    main()
