"""Memory optimizer: find forward subgraphs whose outputs are saved for backward, and recompute some.

Runs inside the partition function on AOTAutograd's joint graph. Every forward value the backward
reads is saved across (a "stashed activation"). For each one, the planner grows the subgraph that
would rebuild it from values that are saved anyway (parameters, inputs, other stashed
activations). Subgraphs are grouped by a readable pattern (ONNX-like op names joined by ``+``, as
upstream's ``Gelu+`` or ``Cast+Where+Softmax+``) and become plans:

- *recompute* (type 1): the subgraph needs nothing new saved; the whole activation is freed.
- *recompute with compromise* (type 2): rebuilding needs a smaller tensor saved instead (a cast's
  narrower input, a broadcast's source...); only part of the activation's bytes are freed.

Level 0 (the default) applies one plan by itself: the attention probabilities of
``scaled_dot_product_attention``, which eager's fused SDPA kernels recompute too (see :func:`_level`).

Applying a plan tags the subgraph's nodes ``CheckpointPolicy.PREFER_RECOMPUTE``; AOTAutograd's
default partitioner then copies them into the backward graph, so the recompute runs in ONNX
Runtime like every other node, never by re-running the user's Python.

Random ops (dropout: ``native_dropout``, ``bernoulli``...) and python ops are never recomputed:
the backward graph runs after other draws from the generator, so a recomputed mask would differ
from the forward's and the gradient would be wrong. Their outputs are stashed; plans that need
them see them as boundaries. Dropout gets one better: its mask (one byte an element) is stashed
anyway for its own backward, so the planner offers ``DropoutFromMask+``, which rebuilds the float
output as ``input * mask * scale`` (what the dropout kernel computes) instead of stashing it.
"""

from __future__ import annotations

import difflib
import logging
import math
import operator
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from ortrain.capture.input_writes import written_back
from ortrain.capture.module_paths import layer_of, module_path
from ortrain.capture.python_ops import PYTHON_OPS
from ortrain.capture.view_ops import RELAYOUTS

logger = logging.getLogger("ortrain.capture")

aten = torch.ops.aten

RECOMPUTE = 1
COMPROMISE = 2
OFF = 0
ALL = -1

_MATMULS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default})
# A convolution is a matmul over patches: its FLOPs scale with the kernel, like a linear layer's.
_CONVOLUTIONS = frozenset({aten.convolution.default, aten._convolution.default})
_SOFTMAXES = frozenset({aten._softmax.default, aten._safe_softmax.default})
# Ops that create a tensor from nothing but scalars: constants, cost nothing to rebuild.
_FACTORIES = frozenset(
    {
        aten.arange.default,
        aten.arange.start,
        aten.arange.start_step,
        aten.ones.default,
        aten.zeros.default,
        aten.full.default,
        aten.scalar_tensor.default,
        aten.empty.memory_format,
    }
)
# ATen name -> ONNX-like name where they differ in more than case.
_READABLE = {
    "mm": "MatMul",
    "bmm": "MatMul",
    "addmm": "Gemm",
    "baddbmm": "Gemm",
    "native_layer_norm": "LayerNormalization",
    "_softmax": "Softmax",
    "_safe_softmax": "Softmax",
    "_log_softmax": "LogSoftmax",
    "_to_copy": "Cast",
    "clone": "Identity",
    "embedding": "Gather",
    "tril": "Trilu",
    "triu": "Trilu",
    "rsqrt": "Rsqrt",
    "masked_fill": "Where",
    "ne": "Not+Equal",
    "eq": "Equal",
    "lt": "Less",
    "gt": "Greater",
    "scalar_tensor": "Constant",
}
# Rough FLOPs per output element of the non-matmul ops that are not one operation an element.
_FLOPS_PER_ELEMENT = {
    "native_layer_norm": 8,
    "_softmax": 5,
    "_safe_softmax": 6,
    "_log_softmax": 5,
    "gelu": 10,
    "silu": 4,
    "tanh": 4,
    "erf": 4,
}


@dataclass(frozen=True)
class RecomputeRequest:
    """One entry of ``ORTMODULE_MEMORY_OPT_CONFIG``: ``pattern:type:count``."""

    pattern: str
    kind: int  # OFF, RECOMPUTE or COMPROMISE
    count: int  # ALL (-1) or how many occurrences, in forward order

    def __str__(self) -> str:
        return f"{self.pattern}:{self.kind}:{self.count}"


@dataclass(frozen=True)
class MemoryOptimizerConfig:
    level: int = 0
    requests: tuple[RecomputeRequest, ...] = ()
    # What was warned about already: one config serves every capture of a wrapper (or of a Dynamo
    # backend), so a request is warned about once, not again at each re-capture (wave 52: the
    # dynamic re-capture repeated the static capture's warning).
    warned: set[str] = field(default_factory=set, compare=False, hash=False, repr=False)


@dataclass
class Occurrence:
    """One place in the graph where a pattern's subgraph rebuilds stashed activations."""

    nodes: list[torch.fx.Node]  # the subgraph, in graph order (relayouts included)
    root: torch.fx.Node
    layer: str | None
    saved_bytes: int  # freed from the stash at the current sizes
    extra_bytes: int  # stashed instead (compromise plans)
    flops: int


@dataclass
class Plan:
    """All occurrences of one pattern: the unit a user configures."""

    pattern: str
    kind: int  # RECOMPUTE or COMPROMISE
    shape: str  # of the stashed activation, symbolic dims by name
    dtype: str
    level: int  # the lowest ORTMODULE_MEMORY_OPT_LEVEL that applies it
    occurrences: list[Occurrence] = field(default_factory=list)
    requested: int | None = None  # count asked for (level or config); None: not requested
    applied: int = 0

    @property
    def bytes_per_occurrence(self) -> int:
        return self.occurrences[0].saved_bytes - self.occurrences[0].extra_bytes

    @property
    def flops_per_occurrence(self) -> int:
        return self.occurrences[0].flops

    @property
    def saved_fraction(self) -> float:
        first = self.occurrences[0]
        return 1.0 - first.extra_bytes / first.saved_bytes if first.saved_bytes else 0.0

    @property
    def layers(self) -> list[str]:
        return sorted({o.layer for o in self.occurrences if o.layer}, key=_natural_key)


@dataclass
class MemoryReport:
    """What the optimizer found and did for one captured graph; its table is :func:`format_summary`."""

    level: int
    requests: tuple[RecomputeRequest, ...]
    plans: list[Plan]
    stashed_bytes_before: int  # what default partitioning would save, at the current sizes
    stashed_bytes: int = 0  # measured on the forward graph the partitioner produced
    stashed_count: int = 0
    unknown_patterns: list[str] = field(default_factory=list)

    def plan(self, pattern: str) -> Plan:
        for plan in self.plans:
            if plan.pattern == pattern:
                return plan
        raise KeyError(f"no memory optimizer plan named {pattern!r}; found {[p.pattern for p in self.plans]}")

    @property
    def applied_bytes(self) -> int:
        return sum(o.saved_bytes - o.extra_bytes for p in self.plans for o in p.occurrences[: p.applied])


def _natural_key(text: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in text.replace(".", " . ").split()]


# ---- reading the joint graph ------------------------------------------------------------------
def _is_forward(node: torch.fx.Node) -> bool:
    return node.meta.get("partitioner_tag") == "is_forward" or (
        node.op == "placeholder" and not node.name.startswith("tangents")
    )


def _must_recompute(node: torch.fx.Node) -> bool:
    return node.meta.get("recompute") in (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)


def _tensor(node: torch.fx.Node) -> torch.Tensor | None:
    value = node.meta.get("val")
    return value if isinstance(value, torch.Tensor) else None


_PLAUSIBLE_SIZE = 2**31


def _hint(size: Any) -> int:
    if isinstance(size, int):
        return size
    node = getattr(size, "node", None)
    if node is None:
        return int(size)
    if node.hint is not None:
        return int(node.hint)  # a SymInt: its value in the batch that was captured
    # A data-dependent size (the rows label sparsity keeps, say) has no value at capture: estimate
    # with its upper bound where the shape environment knows one.
    # An unbounded one (bounded by sys.maxsize in a dynamic capture, or by PyTorch's `int_oo`,
    # whose `is_finite` is True) counts as 1.
    upper = node.shape_env.bound_sympy(node.expr).upper
    return int(upper) if upper.is_Integer and int(upper) < _PLAUSIBLE_SIZE else 1


def _numel(node: torch.fx.Node) -> int:
    value = _tensor(node)
    return math.prod(_hint(s) for s in value.shape) if value is not None else 0


def tensor_bytes(node: torch.fx.Node) -> int:
    value = _tensor(node)
    return _numel(node) * value.element_size() if value is not None else 0


def _is_size(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.SymInt | int)


def _is_multi_output(node: torch.fx.Node) -> bool:
    return bool(node.users) and all(u.target is operator.getitem for u in node.users)


def _recomputable(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target in PYTHON_OPS:
        return False
    if node.target is operator.getitem:
        return _recomputable(node.args[0])  # type: ignore[arg-type]
    tags = getattr(node.target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags or "rng" in str(node.target):
        return False
    if _op_name(node).endswith("_functional"):
        # A functionalized op that updates state (batch norm's running statistics): the forward
        # writes its new values back into the buffer, whose version the backward's recompute then
        # finds moved (wave 43: MEMORY_OPT_LEVEL=1 failed every backward of a model with BatchNorm).
        return False
    # A value whose size is data-dependent (label sparsity's counted rows) stays saved: the
    # backward's decompositions cannot guard on a size known only at run time.
    return not _has_data_dependent_size(node)


def written_inputs(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The inputs (buffers, parameters, user inputs) whose data the forward writes, and their views.

    The functional joint graph reads their old values and returns the new ones; AOTAutograd copies
    those into the inputs after the forward runs (or the graph writes them itself, ``copy_``). A
    value rebuilt in the backward from such an input, or stashed as a view of it, would read the
    new value: an EMA buffer updated then read, spectral norm's ``_u``/``_v`` (wave 54: levels 1
    and 2 failed every backward with "modified by an inplace operation"; where a write escapes the
    version counter the gradient would be silently wrong). Plans stop at the first reader that makes
    a new tensor: it is stashed, holding the old values.
    """
    written = {placeholder for placeholder, _ in written_back(graph)}
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for argument, value in zip(schema.arguments, node.args, strict=False):
            writes = argument.alias_info is not None and argument.alias_info.is_write
            if writes and isinstance(value, torch.fx.Node) and value.op == "placeholder":
                written.add(value)
    for node in graph.nodes:  # views of them share their storage (graph order: sources first)
        if node.op == "call_function" and node.args and node.args[0] in written and _is_view(node):
            written.add(node)
    return written


def _is_view(node: torch.fx.Node) -> bool:
    if node.target is operator.getitem or node.target in RELAYOUTS:
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
    )


def _has_data_dependent_size(node: torch.fx.Node) -> bool:
    value = _tensor(node)
    if value is None:
        return False
    return any(getattr(size, "node", None) is not None and size.node.hint is None for size in value.shape)


def _op_name(node: torch.fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def _readable(node: torch.fx.Node) -> str:
    if _NAME_KEY in node.meta:
        return node.meta[_NAME_KEY]
    name = _op_name(node)
    return _READABLE.get(name) or "".join(part.capitalize() for part in name.strip("_").split("_"))


def _flops(node: torch.fx.Node) -> int:
    if node.target in RELAYOUTS or node.target is operator.getitem or node.target in _FACTORIES:
        return 0
    if node.target in _MATMULS:
        a = _tensor(node.args[-2])  # type: ignore[arg-type]
        if a is None:
            return 0
        return 2 * _numel(node) * _hint(a.shape[-1])
    if node.target in _CONVOLUTIONS:
        return _convolution_flops(node)
    if _is_multi_output(node):
        # Costed by what reads its results, else by its first tensor argument (not the first
        # argument: auto_functionalized's is the operator it wraps; wave 43, a custom op writing
        # its argument and returning None failed the capture).
        tensors = [a for a in node.all_input_nodes if _tensor(a) is not None]
        return sum(_flops(u) for u in node.users) or (8 * _numel(tensors[0]) if tensors else 0)
    return _FLOPS_PER_ELEMENT.get(_op_name(node), 1) * _numel(node)


def _convolution_flops(node: torch.fx.Node) -> int:
    """2 x (output elements) x (input channels a group) x (kernel elements): a multiply and an add each.

    Counted at 1 FLOP an output element before wave 54, a 302 MFLOP convolution showed as 0.5.
    A transposed convolution's weight is (in, out / groups, *kernel): each input element is spread
    over out / groups x kernel outputs, so it is counted from the input's side.
    """
    source, weight = node.args[0], node.args[1]
    transposed = node.args[6] if len(node.args) > 6 else node.kwargs.get("transposed", False)
    kernel = _tensor(weight)  # type: ignore[arg-type]
    if kernel is None:
        return 0
    per_element = math.prod(_hint(s) for s in kernel.shape[1:])
    return 2 * _numel(source if transposed else node) * per_element  # type: ignore[arg-type]


def stashed_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The forward values default partitioning saves for backward, given the recompute tags so far."""
    needed: dict[torch.fx.Node, bool] = {}
    for node in reversed(graph.nodes):
        if not _is_forward(node):
            continue
        needed[node] = any(
            (not _is_forward(u) and u.op != "output") or (_must_recompute(u) and needed.get(u, False))
            for u in node.users
        )
    return [
        n
        for n in graph.nodes
        if needed.get(n)
        and n.op == "call_function"
        and _tensor(n) is not None
        and not _is_multi_output(n)
        and not _must_recompute(n)
    ]


# ---- dropout outputs rebuilt from their masks ----------------------------------------------------
_NAME_KEY = "ortrain_readable_op"


@dataclass
class _MaskedDropout:
    output: torch.fx.Node  # getitem 0 of native_dropout
    masked: torch.fx.Node  # input * mask
    scaled: torch.fx.Node  # ... * scale: stands for the output


def _expose_dropout_outputs(graph: torch.fx.Graph) -> list[_MaskedDropout]:
    """Give each forward dropout a recomputable twin of its output: ``input * mask * scale``.

    The twin reads the mask the dropout drew, so rebuilding it in the backward graph reproduces the
    forward's values exactly (the scale as the kernel rounds it: :func:`_kernel_scale`); only the
    random draw itself is never recomputed.
    """
    exposed = []
    for node in list(graph.nodes):
        if node.target is not aten.native_dropout.default or not _is_forward(node):
            continue
        source, p, train = [*node.args, None][:3]
        outputs = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        if not train or not isinstance(p, float) or not 0.0 < p < 1.0 or set(outputs) != {0, 1}:
            continue
        output, mask = outputs[0], outputs[1]
        assert isinstance(source, torch.fx.Node)
        scale = _kernel_scale(source, p)
        if scale is None:
            continue
        after = max((output, mask), key=lambda n: list(graph.nodes).index(n))
        with graph.inserting_after(after):
            masked = graph.call_function(aten.mul.Tensor, (source, mask))
        with graph.inserting_after(masked):
            scaled = graph.call_function(aten.mul.Tensor, (masked, scale))
        masked.meta.update(
            {k: v for k, v in output.meta.items() if k in ("partitioner_tag", "custom", "seq_nr")}
        )
        scaled.meta.update(masked.meta)
        masked.meta["val"] = source.meta["val"] * mask.meta["val"]
        scaled.meta["val"] = masked.meta["val"] * scale
        masked.meta[_NAME_KEY] = "DropoutFromMask"
        scaled.meta[_NAME_KEY] = ""
        output.replace_all_uses_with(scaled)
        exposed.append(_MaskedDropout(output, masked, scaled))
    return exposed


def _kernel_scale(source: torch.fx.Node, p: float) -> float | None:
    """The scale the dropout kernel multiplies by, as a Python float; None where it is not known.

    PyTorch's CPU kernel (``input.mul(mask).mul_(scale)``) multiplies by ``1 / (1 - p)`` rounded to
    the input's dtype: multiplying a bfloat16 activation by the float ``1 / (1 - p)`` rounds once
    from float32 and differed from it by one bfloat16 unit (wave 54: level 1 changed the output and
    the gradients under bfloat16 autocast). Rounded first, the product is the kernel's bit for bit
    (checked on every bfloat16 and float16 value for 105 rates). CUDA's fused kernel multiplies by
    the float32 scale instead: a half-precision dropout there is left stashed (not checked on one).
    """
    value = _tensor(source)
    if value is None or not value.dtype.is_floating_point:
        return None
    if value.element_size() < 4 and value.device.type != "cpu":
        return None
    return torch.tensor(1.0 / (1.0 - p), dtype=value.dtype).item()


def _restore_dropout_outputs(graph: torch.fx.Graph, exposed: list[_MaskedDropout]) -> None:
    """Undo :func:`_expose_dropout_outputs` where no plan recomputes the twin (Dropout's output is free)."""
    for item in exposed:
        if _must_recompute(item.scaled):
            continue
        item.scaled.replace_all_uses_with(item.output)
        graph.erase_node(item.scaled)
        graph.erase_node(item.masked)


# ---- finding plans ------------------------------------------------------------------------------
def _grow(
    root: torch.fx.Node,
    stashed: set[torch.fx.Node],
    order: dict[torch.fx.Node, int],
    written: set[torch.fx.Node],
) -> tuple[list[torch.fx.Node], list[torch.fx.Node]] | None:
    """The nodes that rebuild ``root`` from stashed values, and the new values that must be stashed."""
    members: set[torch.fx.Node] = set()
    boundary: set[torch.fx.Node] = set()
    todo = [root]
    while todo:
        node = todo.pop()
        if node in members:
            continue
        if node is not root and (node.op != "call_function" or node in stashed or _is_size(node)):
            continue  # a parameter, an input, saved anyway, or a size (sizes always cross as ints)
        # A reader of an input the forward writes reads its old value: in the backward it would
        # read the new one (see written_inputs), so it stays saved.
        if not _recomputable(node) or node in written or any(i in written for i in node.all_input_nodes):
            if node is root:
                return None
            boundary.add(node)
            continue
        members.add(node)
        if node.target is operator.getitem:
            todo.append(node.args[0])  # type: ignore[arg-type]
            continue
        todo.extend(n for n in node.all_input_nodes)
    return sorted(members, key=order.__getitem__), sorted(boundary, key=order.__getitem__)


def _pattern(nodes: Iterable[torch.fx.Node]) -> str:
    names = [
        _readable(n)
        for n in nodes
        if n.target not in RELAYOUTS and n.target is not operator.getitem and n.target not in _FACTORIES
    ]
    names = [name for name in names if name]
    return "".join(f"{name}+" for name in names)


def _level(nodes: Sequence[torch.fx.Node], kind: int) -> int:
    """The lowest level that applies a plan.

    Level 0 (the default) recomputes what eager PyTorch recomputes too: the attention probabilities
    of ``scaled_dot_product_attention``. Eager runs SDPA as one fused kernel (flash attention, on
    the CPU as on CUDA) that saves q, k, v, the output and one log-sum-exp a row, and rebuilds the
    batch x heads x seq x seq probabilities in its backward; capture decomposes SDPA into its math
    form (``_safe_softmax`` marks it), whose probabilities would otherwise be stashed (tiny GPT at
    sequence 512: 128 of the 517 MiB stashed at batch 8, the whole excess over eager's 390).

    Level 1: cheap subgraphs. A batched matmul of two activations (``bmm``) counts as cheap only
    where its plan frees attention probabilities (a softmax follows it in the plan: seq x seq per
    head freed for q @ k^T's FLOPs); rebuilding ``probs @ v`` costs as much and frees seq x head_dim
    (at sequence 512, head 64: 256 FLOP per byte freed against 35).

    Level 2 adds compromise plans, the remaining batched matmuls and subgraphs that recompute a
    linear layer's matmul (``mm``, ``addmm``: a weight times the activations, the bulk of a
    transformer's FLOPs) or a convolution (the bulk of a CNN's).
    """
    if kind == COMPROMISE:
        return 2
    if any(n.target in _MATMULS and n.target is not aten.bmm.default for n in nodes):
        return 2
    if any(n.target in _CONVOLUTIONS for n in nodes):
        return 2  # a convolution layer's work, as a linear layer's matmul (wave 54: was level 1)
    softmax = any(n.target in _SOFTMAXES for n in nodes)
    if any(n.target is aten.bmm.default for n in nodes) and not softmax:
        return 2
    return 0 if any(n.target is aten._safe_softmax.default for n in nodes) else 1


def find_plans(graph: torch.fx.Graph) -> tuple[list[Plan], list[torch.fx.Node]]:
    """Every recompute plan of the joint graph, in forward order, and the stashed values."""
    stashed = stashed_nodes(graph)
    stashed_set = set(stashed)
    plans: dict[tuple[str, int, str], Plan] = {}
    seen_roots: set[torch.fx.Node] = set()
    order = {n: i for i, n in enumerate(graph.nodes)}
    written = written_inputs(graph)
    for value in stashed:
        # A stashed getitem stands for its multi-output op: the op is the root, its stashed
        # outputs are what recomputing it frees (LayerNorm's output, mean and rstd together).
        root = value.args[0] if value.target is operator.getitem else value
        assert isinstance(root, torch.fx.Node)
        if root in seen_roots:
            continue
        seen_roots.add(root)
        outputs = [u for u in root.users if u in stashed_set] if root is not value else [value]
        if all(_tensor(o) is None or _tensor(o).dim() == 0 for o in outputs):  # type: ignore[union-attr]
            continue  # scalars: nothing worth freeing
        grown = _grow(root, stashed_set - set(outputs), order, written)
        if grown is None:
            continue
        members, boundary = grown
        members = sorted(set(members) | set(outputs), key=order.__getitem__)
        saved = sum(tensor_bytes(o) for o in outputs)
        extra = sum(tensor_bytes(b) for b in boundary)
        if extra >= saved:
            continue  # stashing the inputs would cost as much as stashing the output
        kind = COMPROMISE if boundary else RECOMPUTE
        pattern = _pattern(members)
        if not pattern:
            continue
        main = max(outputs, key=tensor_bytes)
        main_value = _tensor(main)
        assert main_value is not None
        shape = "(" + ", ".join(str(s) for s in main_value.shape) + ")"
        key = (pattern, kind, shape)
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = Plan(
                pattern=pattern,
                kind=kind,
                shape=shape,
                dtype=str(main_value.dtype).removeprefix("torch."),
                level=_level(members, kind),
            )
        plan.occurrences.append(
            Occurrence(
                nodes=members,
                root=root,
                layer=layer_of(module_path(root)),
                saved_bytes=saved,
                extra_bytes=extra,
                flops=sum(_flops(n) for n in members),
            )
        )
    return _unique_names(list(plans.values())), stashed


def _unique_names(plans: list[Plan]) -> list[Plan]:
    """Plans that share a pattern but differ in kind or shape get a ``#2``, ``#3`` suffix."""
    counts: Counter[str] = Counter()
    for plan in plans:
        counts[plan.pattern] += 1
        if counts[plan.pattern] > 1:
            plan.pattern = f"{plan.pattern}#{counts[plan.pattern]}"
    return plans


# ---- choosing and applying ------------------------------------------------------------------
def _with_closest(pattern: str, found: Iterable[str]) -> str:
    """``pattern``, followed by the found pattern it was most likely meant to be: names are
    typed by hand from the summary, where ``Gelu`` for ``Gelu+`` or a case slip matched nothing."""
    by_folded = {name.lower(): name for name in found}
    folded = pattern.lower().rstrip("+") + "+"
    matches = [folded] if folded in by_folded else difflib.get_close_matches(folded, by_folded, n=1)
    return f"{pattern} (did you mean {by_folded[matches[0]]}?)" if matches else pattern


def plan_recompute(graph: torch.fx.Graph, config: MemoryOptimizerConfig) -> MemoryReport:
    """Find plans, choose them by level and config, and tag the chosen subgraphs for recompute."""
    exposed = _expose_dropout_outputs(graph)
    plans, stashed = find_plans(graph)
    report = MemoryReport(
        level=config.level,
        requests=config.requests,
        plans=plans,
        stashed_bytes_before=sum(tensor_bytes(n) for n in stashed),
    )
    for plan in plans:
        if config.level >= plan.level:
            plan.requested = ALL
    by_name = {p.pattern: p for p in plans}
    for request in config.requests:
        plan = by_name.get(request.pattern)
        if plan is None:
            report.unknown_patterns.append(request.pattern)
            continue
        if request.kind == OFF:
            plan.requested = None
        elif request.kind == RECOMPUTE and plan.kind == COMPROMISE:
            if str(request) not in config.warned:
                config.warned.add(str(request))
                logger.warning(
                    "memory optimizer: %s frees only part of its activation; request it as %s:2:%d",
                    plan.pattern,
                    plan.pattern,
                    request.count,
                )
            plan.requested = None
        else:
            plan.requested = request.count
    unwarned = [pattern for pattern in report.unknown_patterns if pattern not in config.warned]
    if unwarned:
        config.warned.update(unwarned)
        logger.warning(
            "memory optimizer: no subgraph matches %s in this model; the patterns found are listed "
            "in the memory optimizer summary (ORTMODULE_LOG_LEVEL=INFO)",
            ", ".join(_with_closest(pattern, by_name) for pattern in unwarned),
        )
    for plan in plans:
        if plan.requested is None:
            continue
        chosen = plan.occurrences if plan.requested == ALL else plan.occurrences[: plan.requested]
        for occurrence in chosen:
            for node in occurrence.nodes:
                node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
        plan.applied = len(chosen)
    _restore_dropout_outputs(graph, exposed)
    return report


def record_partition(report: MemoryReport, forward: torch.fx.GraphModule, num_user_outputs: int) -> None:
    """Measure what the forward graph the partitioner produced really stashes for backward."""
    outputs = forward.graph.output_node().args[0]
    stashed = [
        o for o in list(outputs)[num_user_outputs:] if isinstance(o, torch.fx.Node) and _tensor(o) is not None
    ]
    stashed = [o for o in stashed if o.op != "placeholder"]
    report.stashed_bytes = sum(tensor_bytes(o) for o in stashed)
    report.stashed_count = len(stashed)
