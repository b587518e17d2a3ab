"""torchrun as the launcher runs it: ``python -m launcher.torchrun ARGS`` is ``python -m torch.distributed.run ARGS``
(the same arguments, agent, rendezvous and workers), with one cost of its rendezvous removed.

torch's dynamic rendezvous (the c10d backend that ``--standalone`` and elastic runs use) names each event it records
after its caller, found with ``inspect.stack()`` (``dynamic_rendezvous.get_method_name``, torch 2.13, which calls it
twice): that builds the source context of every frame of the stack, ~0.16 s a name on this project's 2-core CPU, nine
names in a 2-worker launch (cProfile of torchrun: most before the first worker starts, two at the end). With no event
handler configured (torch's default) the events are then dropped. Here the caller's name is read from its frame,
which gives the same name (``sys._getframe`` at the same depth) without reading any source. A 2-worker start took
4.18 s with torch's torchrun and 3.79 s with this one (``benchmarks/results/torchrun_start.md``); in the test suite's
warm-started processes (tests/warm_start: deeper stacks, thousands of modules for ``inspect`` to search) a 2-layer
GPT's launch went from 4.3 to 3.0 s.
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
