"""The private half of ``torch.compile(backend="ortrain")``: AOTAutograd under TorchDynamo.

TorchDynamo splits a model into graphs at Python it cannot trace (``.item()``, ``.tolist()``,
value-driven ``if``s, data-dependent sizes) and guards each graph; for every graph it calls the
backend. ortrain's backend runs AOTAutograd on it with the same settings as a whole-model capture
(decompositions, partition, tracing context) and hands each forward and backward FX graph to
``compile_graph``, which builds the runner. AOTAutograd's runtime Function glues the runners to
PyTorch autograd, as in :mod:`ortrain.capture.aot_capture`.

Also here: registration under the name ``"ortrain"``, and the graph-break reasons Dynamo logs.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import linecache
import logging
import os
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from unittest import mock

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, register_backend
from torch._dynamo.exc import (
    BackendCompilerFailed,
    InternalTorchDynamoError,
    TorchRuntimeError,
    unimplemented,
)
from torch._dynamo.variables.misc import RandomClassVariable, RandomVariable
from torch._functorch._aot_autograd.descriptors import PlainAOTInput

from ortrain.capture.aot_capture import GraphRunner, donates_no_saved_tensor
from ortrain.capture.capture_package import handed_over
from ortrain.capture.compile_lock import COMPILE_LOCK
from ortrain.capture.decompositions import decomposition_table
from ortrain.capture.detached_outputs import detached_outputs
from ortrain.capture.function_overrides import dynamo_graph_overrides
from ortrain.capture.functorch_transforms import any_batched
from ortrain.capture.input_views import input_view_chains
from ortrain.capture.memory_optimizer import MemoryOptimizerConfig
from ortrain.capture.output_layouts import traced_layouts
from ortrain.capture.partition import partition
from ortrain.capture.python_ops import UnsupportedFunctionError
from ortrain.capture.running_statistics import batch_norm_statistics, versions_kept
from ortrain.capture.saved_output_copies import SavedOutputs
from ortrain.capture.tracing_context import tracing_context
from ortrain.capture.unused_tangents import UnreachedGradients, leave_unused_tangents_none
from ortrain.errors import exception_chain

logger = logging.getLogger("ortrain.capture")

# (graph, "forward" | "backward", index of this Dynamo graph) -> runner over a list of inputs.
GraphCompiler = Callable[[torch.fx.GraphModule, str, int], GraphRunner]

BACKEND_NAME = "ortrain"
_graph_numbers = iter(range(1 << 62))


# ``jacobian(vectorize=True)`` and ``autograd.grad(is_grads_batched=True)`` hand the backward vmap's
# batched gradients, which have no storage for an executor to read (wave 49's review: "Cannot
# access data pointer of Tensor that doesn't have storage"). The whole-model capture runs them
# (ortrain/ortmodule/second_order.py); a Dynamo graph says what to do.
_BATCHED_GRADIENTS = (
    "ortrain's TorchDynamo graphs (the graph-break path, torch.compile(backend='ortrain')) cannot "
    "take batched gradients (torch.autograd.functional.jacobian(vectorize=True), "
    "autograd.grad(is_grads_batched=True)): use vectorize=False or one gradient per row"
)


def aot_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    compile_graph: GraphCompiler,
    memory: MemoryOptimizerConfig | None = None,
) -> Callable[..., Any]:
    """Compile one Dynamo graph: AOTAutograd, then ``compile_graph`` for its forward and backward.

    ``memory`` chooses the memory optimizer's recompute plans, as for a whole-model capture.
    """
    number = next(_graph_numbers)
    # The positions among the graph's arguments of BatchNorm running statistics that only batch
    # norms write: their version counters stay, as after eager (capture/running_statistics.py).
    statistics: list[int] = []

    def compiler(tag: str) -> Callable[[torch.fx.GraphModule, Any], Any]:
        def compile_fx_graph(graph: torch.fx.GraphModule, _example: Any) -> Any:
            # The backward is compiled at the first backward call, outside Dynamo's lock: take ours.
            # Under Dynamo the graph's signature is one pytree of arguments; the exporter names ONNX
            # inputs after the signature, so give it plain positional placeholders as ORTModule's.
            if type(graph.graph._codegen) is not torch.fx.graph.CodeGen:
                graph.graph.set_codegen(torch.fx.graph.CodeGen())
                graph.recompile()
            # Dynamo's graph module carries Dynamo's own state along (its class and attributes),
            # which torch.export, inside the ONNX exporter, trips over ("Attempting to use
            # FunctionalTensor on its own"): hand over a plain GraphModule of the same graph.
            # (Integer inputs no tensor has as a size are carried where a region goes to ONNX
            # Runtime: ortrain.capture.size_carriers, applied by the exporter.)
            plain = torch.fx.GraphModule(graph, graph.graph)
            detached: frozenset[int] = frozenset()
            saved_outputs: SavedOutputs | None = None
            if tag == "forward":
                # `backward(retain_graph=True)` runs the backward again (wave 44: refused from the
                # first dynamic recompile on, "compiled with non-empty donated buffers"). The
                # metadata is the tracing context's while the forward compiles.
                metadata = getattr(torch._guards.TracingContext.try_get(), "fw_metadata", None)
                donates_no_saved_tensor(metadata)
                detached = detached_outputs(metadata)
                saved_outputs = SavedOutputs(metadata) if metadata is not None else None
                descs = batch_norm_statistics(graph.graph)
                statistics[:] = sorted({d.idx for d in descs if isinstance(d, PlainAOTInput)})
            scalars = _scalar_inputs(plain)
            # Outputs AOTAutograd remakes views from, with the strides returned: views of inputs
            # made by PyTorch, the others in their traced layout.
            views = input_view_chains(plain.graph) if tag == "forward" else {}
            layouts = traced_layouts(plain.graph) if tag == "forward" else {}
            # The gradients that only an unused output's (None) gradient reaches are None, as eager.
            unreached = UnreachedGradients(plain) if tag == "backward" else None
            with COMPILE_LOCK:
                runner = _in_fresh_thread(lambda: compile_graph(plain, tag, number))

            def run(args: list[Any]) -> list[Any]:
                if tag == "backward" and any_batched(args):
                    raise RuntimeError(_BATCHED_GRADIENTS)
                for position, dtype in scalars:
                    if args[position] is not None and args[position].dtype != dtype:
                        args[position] = args[position].to(dtype)
                if unreached is not None and any(a is None for a in args):
                    missing = unreached.missing(args)
                    return unreached.set_none(runner(args), missing)
                if not views and not layouts and not detached and saved_outputs is None:
                    return runner(args)
                inputs = list(args)  # the runner may empty the boxed list
                return handed_over(runner(args), inputs, plain.graph, saved_outputs, detached, layouts, views)

            run._boxed_call = True  # type: ignore[attr-defined]
            return run

        return compile_fx_graph

    backend = aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("forward"),
        partition_fn=functools.partial(partition, memory=memory),
        decompositions=decomposition_table(),
    )
    # Float32 norms for half-precision inputs, the margin losses as eager computes them: see
    # capture/function_overrides.py.
    # As the whole-graph capture does (capture/aot_capture.py): the backward traced outside
    # autocast, where PyTorch recommends calling it.
    settings = torch._functorch.config.patch(backward_pass_autocast="off")
    with COMPILE_LOCK, tracing_context(), dynamo_graph_overrides(), settings:
        compiled = backend(gm, example_inputs)

    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        # As the whole-graph capture: no zeros gradient for an output the loss does not use
        # (capture/unused_tangents.py). Fed through that output's backward, zeros met its
        # derivative, and an infinite one (log of an underflowed probability) made every
        # gradient NaN, where eager never runs that backward.
        kept = [args[i] for i in statistics if i < len(args) and isinstance(args[i], torch.Tensor)]
        with versions_kept(kept):
            outputs = compiled(*args, **kwargs)
        leave_unused_tangents_none(outputs)
        return outputs

    return call


def _in_fresh_thread(build: Callable[[], GraphRunner]) -> GraphRunner:
    """Run ``build`` (ONNX export, which runs torch.export) on a thread of its own, and wait.

    AOTAutograd calls the compilers inside Dynamo's compile of a frame: its tracing context, fake
    and functionalization modes and frame callback are set on this thread, and torch.export started
    under them exports something else (a ``_guards_fn`` call on Dynamo's ``L`` locals). That state
    is thread-local; a new thread starts without it, as ORTModule's export runs after its capture.
    """
    result: list[GraphRunner] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            result.append(build())
        except BaseException as error:
            failure.append(error)

    worker = threading.Thread(target=target, name="ortrain-export")
    worker.start()
    worker.join()
    if failure:
        raise failure[0]
    return result[0]


def register(name: str, backend: Callable[..., Any]) -> None:
    """Make ``torch.compile(backend=name)`` resolve to ``backend`` (once per process).

    Where TorchDynamo already knows ``name`` from the package's entry point and has not loaded it,
    its own lookup imports this module and registers what it loaded: registering here as well,
    in the middle of that import, would trip its duplicate-name check."""
    if _COMPILER_FNS.get(name) is backend:
        return
    if _BACKENDS.get(name) is not None and name not in _COMPILER_FNS:
        return
    _COMPILER_FNS.pop(name, None)
    register_backend(backend, name=name)


def backend_failure(error: BaseException) -> BaseException | None:
    """The error a backend raised, if ``error`` is Dynamo's wrapper around one."""
    if isinstance(error, BackendCompilerFailed):
        return error.inner_exception
    return None


def module_ints_symbolic() -> Any:
    """TorchDynamo's setting that traces an int attribute of a module as a symbolic int, not a
    constant: a forward counting its calls (``self.steps += 1`` used in its math) compiled a graph
    per step, and hit Dynamo's recompile limit at step 65 (wave 47's review)."""
    return torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True)


def dynamo_trace_failure(error: BaseException) -> bool:
    """Whether ``error`` is TorchDynamo's own failure to trace an operator on fake tensors (or an
    internal one), not an error of the user's code, which Dynamo re-raises as it is."""
    return isinstance(error, TorchRuntimeError | InternalTorchDynamoError)


# ---- graph breaks --------------------------------------------------------------------------------
_BREAK_LOGGERS = ("torch._dynamo.symbolic_convert.__graph_breaks", "torch._dynamo.exc.__graph_breaks")
_LOCATION = re.compile(r"in user code at (?P<file>.+?):(?P<line>\d+)")
_REASON = re.compile(r"Graph Break Reason: (?P<reason>.+)")
_FIRST_SENTENCE = re.compile(r"(?P<sentence>.+?\.`?)(?=\s+[A-Z]|$)")
# What TorchDynamo tells torch.compile's users about a graph break, once per process, beside the
# break itself: a 12-line warning to set `capture_scalar_outputs` after `.item()`, and a
# UserWarning to "file an issue on GitHub" for `random.random`. On ORTModule's path the break is
# ortrain's report (one line, its source line), and the advice is for torch.compile, not for it.
# And a page of WARNING when ortrain's capture of a graph fails on an operator whose output size
# depends on values ("Backend compiler exception ... Report an issue to the backend compiler
# repo"): ortrain reports it itself, once (`backend_failure_reason`).
_DYNAMO_NOTICES = {
    "torch._dynamo.variables.tensor": "Graph break from `Tensor.item()`",
    "torch._dynamo.exc": "Backend compiler exception",
}
# And two UserWarnings of its own: an untraceable builtin, and (wave 46's review, Hugging Face's
# CTC models through `is_fsdp_managed_module`) a call to an `functools.lru_cache`-wrapped function,
# which TorchDynamo traces through, ignoring the cache, with a warning of "silent incorrectness"
# meant for torch.compile's users: on this path the function's value enters the graph traced at
# each capture, and the guards of TorchDynamo's own graphs recompile when what it read changes.
_DYNAMO_WARNING = (
    r"(Dynamo does not know how to trace the builtin|Dynamo detected a call to a `?functools\.lru_cache)"
)
# (file, line, reason, whether that code runs in eager PyTorch for want of a capture)
BreakReport = Callable[[str, int, str, bool], None]


class _DropNotice(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


class _BreakHandler(logging.Handler):
    def __init__(self, report: BreakReport) -> None:
        super().__init__(logging.DEBUG)
        self.report = report
        self.thread = threading.get_ident()

    def emit(self, record: logging.LogRecord) -> None:
        if threading.get_ident() != self.thread:
            return
        message = record.getMessage()
        location = _LOCATION.search(message)
        if location is None:
            return
        file, line = location.group("file"), int(location.group("line"))
        eager = backend_failure_reason(message)
        if eager is None and enclosing_function(file, line) == "forward":
            eager = skipped_function_reason(message)
        self.report(file, line, eager or break_reason(message), eager is not None)


_BACKEND_FAILURE = re.compile(r"Backend compiler `[^`]*` failed with (?P<error>.+?)\. Adding a graph break")


def backend_failure_reason(message: str) -> str | None:
    """What ortrain's capture of a TorchDynamo graph failed on, from Dynamo's log of the break it
    makes of such a failure (TorchDynamo then runs that graph's code in eager PyTorch); None for
    any other break. Dynamo lets a backend fail this way only on fake tensors' refusals: an
    operator whose output size depends on values (mostly a backward's ``grad[mask]``), one fake
    tensors cannot run."""
    failure = _BACKEND_FAILURE.search(message)
    if failure is None:
        return None
    return (
        f"ortrain could not capture TorchDynamo's graph of this code ({failure.group('error')}: an "
        "output size that depends on values, or an operator fake tensors cannot run, in its "
        "forward or its backward), which therefore runs in eager PyTorch"
    )


_SKIPPED = "Skipping the function and falling back to eager"


def skipped_function_reason(message: str) -> str | None:
    """Why TorchDynamo gave up a whole function, which then runs in eager PyTorch (a break it could
    not resume from: a value-sized ``torch.where`` in a mixture of experts' loop over experts);
    None for any other break. Until wave 48 such a break was told at INFO only, and a model whose
    forward it was trained in PyTorch at every step, under FALLBACK_DISABLE too. Asked of a
    module's ``forward`` only (the handler's caller): a helper it gives up (a loop of ``print``
    or log calls, the review of wave 48's diff) holds no tensor work as a rule, and stays INFO."""
    if _SKIPPED not in message:
        return None
    # The break behind it, without TorchDynamo's wrapping sentences.
    reason = break_reason(message).partition("Graph break encountered:")[2].strip().strip("()")
    return (
        f"TorchDynamo could not split this function at a graph break ({reason or 'unsupported Python'}), "
        "so the whole function runs in eager PyTorch"
    )


@functools.lru_cache(maxsize=256)
def _function_spans(file: str) -> tuple[tuple[int, int, str], ...]:
    try:
        tree = ast.parse("".join(linecache.getlines(file)))
    except (SyntaxError, ValueError):
        return ()
    return tuple(
        (node.lineno, node.end_lineno or node.lineno, node.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    )


def enclosing_function(file: str, line: int) -> str | None:
    """The name of the innermost function of ``file`` whose code holds ``line`` (None if none)."""
    spans = [span for span in _function_spans(file) if span[0] <= line <= span[1]]
    return max(spans, key=lambda span: span[0])[2] if spans else None


def break_reason(message: str) -> str:
    """The break's title and the first sentence of its explanation, from Dynamo's log of a break
    (whose first line names only the bytecode it stopped at: "Encountered graph break when
    attempting to trace CALL: a function call")."""
    reason = _REASON.search(message)
    if reason is None:
        return "unsupported Python"
    text = message[reason.start("reason") :].split("User code traceback:")[0]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Encountered graph break"):
        lines = lines[1:]
    explanation = next((line for line in lines[1:] if line.startswith("Explanation:")), "")
    sentence = _FIRST_SENTENCE.match(explanation.removeprefix("Explanation:").strip())
    first_sentence = sentence.group("sentence").removesuffix(".") if sentence else ""
    return f"{lines[0]} ({first_sentence})" if first_sentence else lines[0]


@contextlib.contextmanager
def graph_breaks_reported(report: BreakReport) -> Iterator[None]:
    """Call ``report(file, line, reason, eager)`` for each graph break Dynamo finds in this thread
    meanwhile (``eager``: the break is Dynamo's answer to a capture ortrain failed, whose code runs
    in eager PyTorch);
    TorchDynamo's own notices of those breaks (advice for torch.compile) are not shown meanwhile."""
    handler = _BreakHandler(report)
    loggers = [logging.getLogger(name) for name in _BREAK_LOGGERS]
    saved = [(lg.level, lg.propagate) for lg in loggers]
    notices = [(logging.getLogger(name), _DropNotice(prefix)) for name, prefix in _DYNAMO_NOTICES.items()]
    for lg in loggers:
        lg.addHandler(handler)
        if not lg.isEnabledFor(logging.DEBUG):
            # Off unless TORCH_LOGS asked for it: turn it on for our handler only, not for torch's.
            lg.setLevel(logging.DEBUG)
            lg.propagate = False
    for lg, drop in notices:
        lg.addFilter(drop)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_DYNAMO_WARNING, category=UserWarning)
            yield
    finally:
        for lg, drop in notices:
            lg.removeFilter(drop)
        for lg, (level, propagate) in zip(loggers, saved, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)
            lg.propagate = propagate


# A model on the graph-break path recompiles for each mode it meets (train/eval, grad/no_grad,
# flags in its arguments, a cache object it is given): TorchDynamo's default limit of 8 entries
# per function was reached within a few Hugging Face evaluation calls, after which it ran that
# function in eager PyTorch with only its own warning (wave 43's review).
RECOMPILE_LIMIT = 64
_LIMIT_NOTICE = "torch._dynamo hit config."


class _LimitHandler(logging.Handler):
    def __init__(self, report: Callable[[str], None]) -> None:
        super().__init__(logging.WARNING)
        self.report = report

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(_LIMIT_NOTICE):
            self.report(" ".join(message.splitlines()[:2]))


@contextlib.contextmanager
def recompile_limit_watched(report: Callable[[str], None]) -> Iterator[None]:
    """Run TorchDynamo with a limit of :data:`RECOMPILE_LIMIT` entries per function (or the user's,
    if higher), and call ``report(notice)`` when a function reaches it: from then on it runs in
    eager PyTorch."""
    limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    handler = _LimitHandler(report)
    dynamo_log = logging.getLogger("torch._dynamo.convert_frame")
    saved = dynamo_log.level, dynamo_log.propagate
    if not dynamo_log.isEnabledFor(logging.WARNING):
        # TorchDynamo's logs quieted (torch._logging.set_logs): its notice for our handler only.
        dynamo_log.setLevel(logging.WARNING)
        dynamo_log.propagate = False
    dynamo_log.addHandler(handler)
    try:
        with torch._dynamo.config.patch(recompile_limit=limit):
            yield
    finally:
        dynamo_log.removeHandler(handler)
        dynamo_log.setLevel(saved[0])
        dynamo_log.propagate = saved[1]


def _scalar_inputs(graph: torch.fx.GraphModule) -> list[tuple[int, torch.dtype]]:
    """0-d tensor inputs and the dtype the graph was traced with. A Python float that changes
    between calls (``random.uniform(0.5, 2)``) is a 0-d input that Dynamo traces as float32 and
    passes as float64, which ONNX Runtime refuses ("Unexpected input data type")."""
    placeholders = graph.graph.find_nodes(op="placeholder")
    return [
        (position, value.dtype)
        for position, node in enumerate(placeholders)
        if isinstance(value := node.meta.get("val"), torch.Tensor) and value.dim() == 0
    ]


@contextlib.contextmanager
def hooks_guarded() -> Iterator[None]:
    """TorchDynamo as eager as it can be, meanwhile: it guards on the modules' hooks (by default it
    does not, and a forward hook added or removed after compiling would be ignored: the graphs of
    the old hooks run on), ``numpy.random`` inside a compiled frame draws from NumPy's own
    generator (by default from PyTorch's: SpecAugment's masks in Wav2Vec2 and Whisper were other
    masks than eager's under the same seeds, losses off by 0.07), and a ``random.Random`` the model
    holds is called at every step. TorchDynamo traces such a generator's draws on a copy of it and
    guards only its type: ``self.rng.uniform(0.5, 1.5)`` became a constant of the graph and the
    generator was set back to the traced state at every run, the same number drawn at every step.
    Seen as an ordinary object, its draws are a graph break, run by Python each time."""
    with (
        torch._dynamo.config.patch(skip_nnmodule_hook_guards=False, use_numpy_random_stream=True),
        mock.patch.object(RandomVariable, "is_supported_random_obj", staticmethod(_never)),
        mock.patch.object(RandomClassVariable, "call_function", _unseeded_random_breaks),
    ):
        yield


def _never(value: object) -> bool:
    return False


_TRACED_RANDOM_CLASS = RandomClassVariable.call_function


def _unseeded_random_breaks(self: Any, tx: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """``random.Random()`` made in a compiled frame without a seed (LayerDrop's): TorchDynamo
    seeds its traced copy once, and every run then drew the same numbers (wave 47's review: the
    same layers dropped at every step). A graph break makes it in Python, at every run; a seeded
    one (``random.Random(seed)``) draws the same numbers at every run in eager too."""
    if not args and not kwargs:
        unimplemented(
            gb_type="random.Random() without a seed",
            context="ortrain",
            explanation="an unseeded generator made in the forward draws anew at every call",
            hints=[],
        )
    return _TRACED_RANDOM_CLASS(self, tx, args, kwargs)


def source_line(file: str, line: int) -> str:
    return linecache.getline(file, line).strip()


# ---- errors a whole-graph capture fails with that TorchDynamo's graphs do not ---------------------
def reads_outside_tensors(error: BaseException) -> bool:
    """Whether a whole-graph capture failed on a real tensor the forward reads from outside the
    model's parameters, buffers and tensor attributes: a module kept in a list (a distillation
    teacher hidden from ``parameters()``), tensors in a list, a module-level tensor. AOTAutograd
    lifts only the module's own state; TorchDynamo guards such tensors and passes them as inputs."""
    return any("Please convert all Tensors to FakeTensors first" in str(e) for e in exception_chain(error))


def on_sparse_tensors(error: BaseException) -> bool:
    """Whether a whole-graph capture failed on a sparse tensor the forward builds: AOTAutograd's
    joint trace of ``torch.sparse_coo_tensor(edges, learned_weights, (n, n))`` fails in the
    constructor's backward ("SparseCooTensorWithDimsAndTensorsBackward0 returned an invalid
    gradient"), and the model fell back to PyTorch (wave 51's review); through TorchDynamo's graphs
    it trains, the sparse operators in PyTorch."""
    return any(re.search(r"\bSparse\w*Backward\d*\b", str(e)) for e in exception_chain(error))


def in_control_flow_operator(error: BaseException) -> bool:
    """Whether a whole-graph capture failed inside one of PyTorch's control-flow operators
    (``torch.cond``, ``torch.while_loop``, ``scan``, ``map``). AOTAutograd differentiates them
    only as TorchDynamo hands them over: a ``torch.cond`` branch returning a tensor rather than a
    tuple failed deep in its backward ("object of type 'bool' has no len()") and the model fell
    back to PyTorch; through TorchDynamo's graphs it trains."""
    for current in exception_chain(error):
        frame = current.__traceback__
        while frame is not None:
            if f"{os.sep}torch{os.sep}_higher_order_ops{os.sep}" in frame.tb_frame.f_code.co_filename:
                return True
            frame = frame.tb_next
    return False


# ---- errors that mean "this model has data-dependent Python" --------------------------------------
def is_data_dependent(error: BaseException) -> bool:
    """Whether a whole-graph capture failed on Python that depends on tensor values."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    kinds = (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)
    for current in exception_chain(error):
        if isinstance(current, UnsupportedFunctionError):
            # An opaque Function that cannot be a python op: named, and judged by the fallback policy.
            return False
        if isinstance(current, kinds):
            return True
        if "data-dependent" in str(current) or "data dependent" in str(current):
            return True
        if ".numpy() is not supported for tensor subclasses" in str(current):
            return True  # NumPy in forward reads the values: TorchDynamo traces through it
    return False
