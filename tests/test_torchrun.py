"""launcher.torchrun: torch's torchrun with the rendezvous's caller names read from frames. The name it gives is the
one ``inspect.stack()`` gave (torch's ``get_method_name``), at every depth torch asks for and past the stack's end;
tests/test_launch*.py and the probes run every worker under it."""

import inspect

from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from launcher.torchrun import _method_name

TORCH_GET_METHOD_NAME = dynamic_rendezvous.get_method_name      # torch's own (this process never runs main())


def _record_like(names, depth):
    """Where torch calls it from: a ``_record`` method, one frame below the method whose name is wanted."""
    return names(depth)


def rendezvous_step(names, depth=2):
    return _record_like(names, depth)


def test_the_frame_walk_names_the_same_caller_as_inspect_stack():
    assert TORCH_GET_METHOD_NAME is not _method_name
    for depth in (1, 2, 3):
        assert rendezvous_step(_method_name, depth) == rendezvous_step(TORCH_GET_METHOD_NAME, depth)
    assert rendezvous_step(_method_name) == "rendezvous_step"
    too_deep = len(inspect.stack()) + 5
    assert _method_name(too_deep) == TORCH_GET_METHOD_NAME(too_deep) == "no_method_name"
