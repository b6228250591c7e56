"""FX graph modules that generate their Python code only when something calls or reads it.

Every ``torch.fx.GraphModule`` compiles its graph's Python source as it is built, each time its
graph is replaced, and on each deep copy (``torch.fx.graph_module._exec_with_source``): a first
step of the tiny GPT built 34 such modules of up to 1 600 nodes while capturing, partitioning and
exporting, 0.19 s of Python compilation for code that is mostly never run, since ONNX Runtime runs
the graphs. torch's ``_LazyGraphModule`` (what Inductor builds its graphs with) defers that
compilation to the first call or the first read of ``code``; a graph that runs in PyTorch (a
segment the partitioner gives to PyTorch, a fallback) compiles then, unchanged.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch.fx import _lazy_graph_module


@contextlib.contextmanager
def graph_modules_compiled_on_first_call() -> Iterator[None]:
    """Graph modules built inside compile their code on their first call, not when built."""
    with _lazy_graph_module._use_lazy_graph_module(True):
        yield


def graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """``torch.fx.GraphModule(root, graph)``, lazy inside :func:`graph_modules_compiled_on_first_call`."""
    return _lazy_graph_module._make_graph_module(root, graph)


def deep_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A deep copy of ``gm`` that generates its code on its first call.

    A deep copy rebuilds the module through ``GraphModule.__init__``, which compiles the code of
    any module that is not lazy itself (the regions torch's partitioner fuses are plain modules).
    """
    return copy.deepcopy(_lazy_graph_module._LazyGraphModule.from_graphmodule(gm))


def compiled_on_first_call(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` (or a module over the same graph) whose code is generated on its first call."""
    return _lazy_graph_module._LazyGraphModule.from_graphmodule(gm)


def compile_now(gm: torch.fx.GraphModule) -> None:
    """Generate ``gm``'s code now: callers that read ``forward``'s signature (``torch.export``) need
    the generated one, not the lazy stub's ``*args``."""
    _lazy_graph_module._LazyGraphModule.force_recompile(gm)
