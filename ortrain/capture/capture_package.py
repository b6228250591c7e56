"""A capture as bytes: a later process runs it without tracing the model again.

AOTAutograd's own cache format does the hard part. Its bundled entry holds the runtime metadata
(input mutations, aliased outputs, effect tokens, which forward outputs are saved for the
backward, which inputs to detach) and rebuilds the same ``autograd.Function`` glue around the
loaded forward and backward "compiled" graphs. ortrain's compiled graphs are :class:`GraphCode`
objects: an FX graph and the executor running it. The graph travels as bytes through
``GraphPickler`` (which keeps each node's fake value, symbolic sizes included); the executor does
not travel: the loading process builds it again from the graph, through the export cache.

Only ``torch.fx`` operators are stored by name; a graph that calls Python (opaque custom
``autograd.Function``s, reentrant checkpoints) refers to objects of the process that captured it
and is never packaged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any
from unittest import mock

import torch
from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
from torch._functorch._aot_autograd.schemas import AOTAutogradCacheInfo
from torch._inductor.output_code import OutputCode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._graph_pickler import GraphPickler, Options
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ortrain.capture.detached_outputs import detach_views
from ortrain.capture.input_views import input_view_chains, make_views
from ortrain.capture.lazy_recompile import compiled_on_first_call
from ortrain.capture.output_layouts import Layouts, in_traced_layouts
from ortrain.capture.saved_output_copies import SavedOutputs
from ortrain.capture.unused_tangents import UnreachedGradients, with_zero_tangents

if TYPE_CHECKING:
    from ortrain.capture.aot_capture import GraphSlot

# Bump when what a package holds changes shape: an old entry then fails to load and is rebuilt.
FORMAT = 3  # 2: entries carry their size guards (ortrain.capture.size_guards); 3: detached outputs
_KEPT_METADATA = frozenset({"val"})


def handed_over(
    outputs: Sequence[Any],
    args: Sequence[Any],
    graph: torch.fx.Graph,
    saved_outputs: SavedOutputs | None,
    detached: frozenset[int],
    layouts: Layouts,
    views: dict[int, Any],
) -> list[Any]:
    """A compiled forward's ``outputs`` (run on ``args``) as AOTAutograd is to hand them on, on
    ORTModule's path and under ``torch.compile(backend="ortrain")`` alike: copies of those sharing
    a saved tensor's memory (saved_output_copies), detached views where nothing requires grad
    (detached_outputs), the traced layouts (output_layouts), and views of inputs made by PyTorch
    (input_views)."""
    outputs = list(outputs)
    if saved_outputs is not None:
        saved_outputs.copy_shared(outputs)
    detach_views(detached, outputs)
    in_traced_layouts(layouts, outputs)
    make_views(views, graph, args, outputs)
    return outputs


class GraphCode(OutputCode):
    """What ortrain's compilers hand AOTAutograd: one graph and the executor that runs it."""

    def __init__(
        self,
        slot: GraphSlot,
        output_layouts: Layouts | None = None,
        forward: bool = False,
        detached: frozenset[int] = frozenset(),
        saved_outputs: SavedOutputs | None = None,
    ) -> None:
        super().__init__()
        self.slot: GraphSlot | None = slot
        self._graph_bytes: bytes | None = None
        self._boxed_call = True
        # Output position -> the dimension order or strides to hand it over in (output_layouts);
        # plain data, saved with the cache entry.
        self.output_layouts = output_layouts or {}
        # A forward's outputs that are views of its inputs are made by PyTorch on the inputs
        # (ortrain.capture.input_views): AOTAutograd remakes them from the input with the strides
        # of what ONNX Runtime returned, contiguous, and ``x[:, :1].expand(b, s, d)`` (symbolic
        # strides, which output_layouts cannot give) came back as ``x`` itself from the second,
        # dynamic capture on (wave 43, silently).
        self.forward = forward
        # Outputs that do not require grad, detached where a runner made them views of another
        # (ortrain.capture.detached_outputs).
        self.detached = detached
        # Returned outputs sharing memory with a saved tensor, handed over as copies
        # (ortrain.capture.saved_output_copies).
        self.saved_outputs = saved_outputs

    def __call__(self, inputs: Sequence[Any]) -> Any:
        assert self.slot is not None, "a loaded GraphCode runs only after post_compile"
        args = list(inputs)
        if isinstance(inputs, list):
            # Boxed calling convention: the caller's list is AOTAutograd's only reference to the
            # saved tensors (it cleared the autograd context's); emptied, each can be freed as soon
            # as the graph's runner drops it, as eager frees a saved tensor after its node.
            inputs.clear()
        # A forward's inputs, kept for the views made of them (a backward's saved tensors are not:
        # each is freed as soon as the graph's runner drops it).
        kept = list(args) if getattr(self, "forward", False) else []
        if not any(a is None for a in args):
            return self._laid_out(self.slot.run(args), kept)
        unreached = self._unreached()
        missing = unreached.missing(args)
        if self.slot.runner is None:
            args = with_zero_tangents(self.slot.graph, args)  # the FX graph needs real tensors
        return self._laid_out(unreached.set_none(self.slot.run(args), missing), kept)

    def _laid_out(self, outputs: Any, args: list[Any]) -> Any:
        layouts = getattr(self, "output_layouts", None)  # absent on entries saved before wave 38
        views = self._input_views()
        detached = getattr(self, "detached", frozenset())  # absent on objects made before wave 45
        saved_outputs = getattr(self, "saved_outputs", None)  # absent on objects made before wave 47
        if not layouts and not views and not detached and saved_outputs is None:
            return outputs
        assert self.slot is not None
        return handed_over(
            outputs, args, self.slot.graph.graph, saved_outputs, detached, layouts or {}, views
        )

    def _input_views(self) -> dict[int, Any]:
        if not getattr(self, "forward", False):  # absent on entries saved before wave 43
            return {}
        known = getattr(self, "_views", None)  # graph nodes: made again after a cache load
        if known is None:
            assert self.slot is not None
            known = self._views = input_view_chains(self.slot.graph.graph)
        return known

    def _unreached(self) -> UnreachedGradients:
        assert self.slot is not None
        known = getattr(self, "_unreached_gradients", None)  # absent on objects loaded from a cache
        if known is None:
            known = self._unreached_gradients = UnreachedGradients(self.slot.graph)
        return known

    def prepare_for_serialization(self) -> None:
        # Called on a shallow copy of the live object (AOTAutograd's pre_save): the live one keeps
        # its slot and executor.
        assert self.slot is not None
        self._graph_bytes = GraphPickler.dumps(
            self.slot.graph,
            # Every operator is stored by name (the safe filter stops at aten). Of the node metadata
            # only the fake values: nothing after capture reads the rest (provenance, stack
            # traces, module stacks), which doubled the size and the load time.
            Options(ops_filter=None, node_metadata_key_filter=_KEPT_METADATA.__contains__),
        )
        self.slot = None
        self._views = None  # nodes of the live graph: made again from the loaded one

    def post_compile(self, example_inputs: Sequence[Any], constants: Any, graph_kwargs: Any) -> None:
        if self.slot is not None:
            return
        from ortrain.capture.aot_capture import GraphSlot

        context = torch._guards.TracingContext.get()
        assert self._graph_bytes is not None
        graph = GraphPickler.loads(self._graph_bytes, context.fake_mode)
        assert isinstance(graph, torch.fx.GraphModule)
        # Its code is generated only if PyTorch runs it: ONNX Runtime runs what it exports.
        self.slot = GraphSlot(compiled_on_first_call(graph))
        self._graph_bytes = None

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass


@contextlib.contextmanager
def recording_entries(joint: Any, entries: list[Any]) -> Iterator[None]:
    """Make the compile after ``aot_export_joint_with_descriptors`` produce AOTAutograd's bundled
    cache entry and hand it to ``entries`` instead of writing it to torch's own cache directory."""
    state = joint._aot_state
    state.aot_config = dataclasses.replace(
        state.aot_config,
        cache_info=AOTAutogradCacheInfo("ortrain", time.time_ns(), forward_symints=[]),
    )

    def record(key: str, entry: Any, remote: bool) -> None:
        entries.append(entry)

    patched_config = torch._functorch.config.patch(
        {"bundled_autograd_cache": True, "force_non_lazy_backward_lowering": True}
    )
    with patched_config, mock.patch.object(AOTAutogradCache, "save", staticmethod(record)):
        yield


def package_bytes(entry: Any) -> bytes:
    """The bytes of a recorded entry (raises ``pickle.PicklingError`` / ``TypeError`` where a part of
    the capture cannot be stored)."""
    entry.pre_save()
    with torch.utils._python_dispatch._disable_current_modes():
        return pickle.dumps((FORMAT, entry))


@dataclasses.dataclass
class LoadedCapture:
    fn: Callable[..., Any]
    forward: GraphSlot
    backward: GraphSlot | None


def load_package(data: bytes) -> LoadedCapture:
    """Rebuild AOTAutograd's callable over ``(*params_and_buffers, *inputs)`` from
    :func:`package_bytes`; the slots it returns have no executor yet (their graphs run in PyTorch
    until one is installed)."""
    version, entry = pickle.loads(data)
    if version != FORMAT:
        raise ValueError(f"package format {version}, this ortrain reads {FORMAT}")
    entry.guards_expr = None  # ortrain matches sizes itself (ortmodule's _CompiledEntry)
    context = torch._guards.TracingContext(FakeTensorMode(shape_env=ShapeEnv()))
    with torch._guards.tracing(context):
        from torch._inductor.cudagraph_utils import BoxedDeviceIndex
        from torch._inductor.utils import BoxedBool

        compiled = entry.wrap_post_compile(
            [],
            entry.sanitized_aot_config,
            {"cudagraphs": BoxedBool(False), "boxed_forward_device_index": BoxedDeviceIndex(None)},
        )
    forward = entry.compiled_fw.result
    backward = entry.compiled_bw.result if entry.compiled_bw is not None else None
    assert isinstance(forward, GraphCode) and forward.slot is not None

    def fn(*args: Any) -> Any:
        return compiled(list(args))

    return LoadedCapture(fn, forward.slot, backward.slot if isinstance(backward, GraphCode) else None)
