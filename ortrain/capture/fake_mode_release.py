"""After a capture, the fake modes it used forget the real tensors they converted.

A fake mode maps each real tensor it converted (the model's parameters and buffers, the inputs)
to its fake one through weak references, and the captured graphs keep their fake modes alive (the
fake values on their nodes). A weak reference on a parameter makes ``torch.utils.swap_tensors``
refuse it, so ``model.double()`` under ``torch.__future__.set_swap_module_params_on_conversion``
(what ``load_state_dict(assign=True)`` and FSDP's conversions rely on) failed after the first step:
"Cannot swap t1 because it has weakref associated with it". Nothing converts a real tensor in a
capture's fake mode once the capture is done, and one that did would convert it afresh.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils.weak import WeakIdKeyDictionary


def graph_fake_modes(graphs: Iterable[torch.fx.GraphModule | None]) -> list[FakeTensorMode]:
    """The fake modes of the fake values on ``graphs``' placeholders, each once."""
    modes: dict[int, FakeTensorMode] = {}
    for graph in graphs:
        if graph is None:
            continue
        for node in graph.graph.find_nodes(op="placeholder"):
            value = node.meta.get("val")
            if isinstance(value, FakeTensor):
                modes.setdefault(id(value.fake_mode), value.fake_mode)
    return list(modes.values())


def forget_real_tensors(modes: Iterable[FakeTensorMode]) -> None:
    """Drop each mode's weak references to the real tensors and storages it converted. Their ids
    are not reused (the describer's counters go on), so a later conversion cannot meet an old one."""
    for mode in modes:
        describer = mode.fake_tensor_converter.meta_converter.describer
        describer.lookup_tensor = WeakIdKeyDictionary()
        describer.lookup_storage = WeakIdKeyDictionary()
