"""Which inputs feed an embedding's indices or a loss's labels, and how dense they are each step.

At capture the pre-dispatch forward graph is searched from every ``embedding`` (its indices and
``padding_idx``) and every class-label loss (its target and ``ignore_index``) back to the graph
input they come from, through reshapes, slices, shifts and pads (Hugging Face causal LMs shift
the labels inside the model). Each step the density of those inputs is measured on the real
tensors: embedding density = tokens that are not ``padding_idx`` / all tokens; label density =
labels that are not ``ignore_index`` / all labels. The figures say whether the sparsity
optimizers (ORTMODULE_ENABLE_SPARSE_OPTIMIZER, ..._EMBEDDING_SPARSE_OPTIMIZER) will pay off.

Only the last :data:`WINDOW` steps are kept as records (``records``, for plotting; set ``window``
to keep more or fewer); every step counts in each input's running figures (``totals``: steps,
lowest, mean and highest density), which is what the summary at the end shows. Until wave 52 every
step was kept and the end logged one row per step and input: unbounded memory and log.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from ortrain.passes.label_density import source_placeholder
from ortrain.passes.linear_cross_entropy import linear_cross_entropy

logger = logging.getLogger("ortrain.inspector")

aten = torch.ops.aten

WINDOW = 1000  # steps kept as records; older steps count in the running figures only

# loss -> (position of its labels, position of ignore_index, its default)
_LOSSES: dict[object, tuple[int, int, int]] = {
    aten.cross_entropy_loss.default: (1, 4, -100),
    aten.nll_loss_nd.default: (1, 4, -100),
    aten.nll_loss.default: (1, 4, -100),
    aten.nll_loss_forward.default: (1, 4, -100),
    aten.nll_loss2d.default: (1, 4, -100),
    # The LM head fused with its loss (ORTMODULE_FUSE_LINEAR_CROSS_ENTROPY, on by default): the
    # trace holds it in place of cross_entropy. Wave 15: its labels went unseen.
    linear_cross_entropy: (4, 6, -100),
}


@dataclass(frozen=True)
class DensitySource:
    """One graph input that feeds an embedding (``kind="embedding"``) or a loss (``kind="label"``)."""

    input_index: int  # position among the flat user inputs
    kind: str
    ignored_value: int  # padding_idx or ignore_index


@dataclass(frozen=True)
class DensityRecord:
    step: int
    input_name: str
    embedding_density: float | None  # None: the input feeds no embedding with a padding_idx
    label_density: float | None  # None: the input feeds no loss


def _source_input(node: object, inputs: dict[torch.fx.Node, int]) -> int | None:
    source = source_placeholder(node)
    return None if source is None else inputs.get(source)


def find_density_sources(
    graph: torch.fx.Graph, input_placeholders: list[torch.fx.Node]
) -> list[DensitySource]:
    """The inputs that feed embeddings with a ``padding_idx`` and losses with labels, in ``graph``."""
    inputs = {node: i for i, node in enumerate(input_placeholders)}
    sources: list[DensitySource] = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.embedding.default:
            padding_idx = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
            index = _source_input(node.args[1], inputs)
            if index is not None and isinstance(padding_idx, int) and padding_idx >= 0:
                sources.append(DensitySource(index, "embedding", padding_idx))
        elif node.target in _LOSSES:
            labels, position, default = _LOSSES[node.target]
            ignore_index = (
                node.args[position] if len(node.args) > position else node.kwargs.get("ignore_index", default)
            )
            index = _source_input(node.args[labels], inputs)
            if index is not None and isinstance(ignore_index, int):
                sources.append(DensitySource(index, "label", ignore_index))
    return list(dict.fromkeys(sources))


def _density(tensor: torch.Tensor, ignored: int) -> float:
    total = tensor.numel()
    return float((tensor != ignored).sum().item()) / total if total else 1.0


@dataclass
class DensityFigures:
    """One kind of density of one input over every step recorded: lowest, mean, highest."""

    steps: int = 0
    lowest: float = 1.0
    highest: float = 0.0
    total: float = 0.0

    def add(self, value: float) -> None:
        self.steps += 1
        self.lowest = min(self.lowest, value)
        self.highest = max(self.highest, value)
        self.total += value

    @property
    def mean(self) -> float:
        return self.total / self.steps if self.steps else 0.0

    def __str__(self) -> str:
        return f"{_percent(self.lowest)} / {_percent(self.mean)} / {_percent(self.highest)}"


@dataclass
class InputTotals:
    """An input's figures over every step it was measured at."""

    steps: int = 0
    embedding: DensityFigures = field(default_factory=DensityFigures)
    label: DensityFigures = field(default_factory=DensityFigures)


class InputDensity:
    """Density figures of the last ``window`` steps and running figures of every step, logged as a
    table at step 1, every ``interval`` steps and at the end."""

    def __init__(self, interval: int = 10, window: int = WINDOW) -> None:
        self.interval = interval
        self.window = window
        self._recent: deque[DensityRecord] = deque()
        self._unlogged: list[DensityRecord] = []  # at most ``interval`` steps' records
        self.totals: dict[str, InputTotals] = {}

    @property
    def records(self) -> list[DensityRecord]:
        """The records of the last ``window`` steps, oldest first."""
        return list(self._recent)

    def record(
        self, step: int, sources: list[DensitySource], names: list[str], inputs: list[torch.Tensor]
    ) -> list[DensityRecord]:
        by_input: dict[int, dict[str, float]] = {}
        for source in sources:
            tensor = inputs[source.input_index]
            by_input.setdefault(source.input_index, {})[source.kind] = _density(tensor, source.ignored_value)
        new = [
            DensityRecord(step, names[i], kinds.get("embedding"), kinds.get("label"))
            for i, kinds in sorted(by_input.items())
        ]
        for r in new:
            totals = self.totals.setdefault(r.input_name, InputTotals())
            totals.steps += 1
            if r.embedding_density is not None:
                totals.embedding.add(r.embedding_density)
            if r.label_density is not None:
                totals.label.add(r.label_density)
        self._recent.extend(new)
        while self._recent and self._recent[0].step <= step - self.window:
            self._recent.popleft()
        self._unlogged += new
        if step == 1 or step % self.interval == 0:
            self.log(f"input density at step {step}")
        return new

    def table(self, records: list[DensityRecord] | None = None) -> str:
        rows = self.records if records is None else records
        lines = ["| step | input | embedding density | label density |", "|---:|---|---:|---:|"]
        for r in rows:
            embedding, label = _percent(r.embedding_density), _percent(r.label_density)
            lines.append(f"| {r.step} | {r.input_name} | {embedding} | {label} |")
        return "\n".join(lines)

    def log(self, title: str) -> None:
        """Log the records not logged yet, under ``title``."""
        if self._unlogged:
            logger.info("%s\n%s", title, self.table(self._unlogged))
            self._unlogged = []

    def summary(self) -> str:
        """Each input's density over every step recorded, lowest / mean / highest (what is logged
        at the end): one row an input, however long the run."""
        lines = [
            "| input | steps | embedding density, lowest / mean / highest | label density, lowest / mean / "
            "highest |",
            "|---|---:|---:|---:|",
        ]
        for name, t in self.totals.items():
            embedding = str(t.embedding) if t.embedding.steps else "-"
            label = str(t.label) if t.label.steps else "-"
            lines.append(f"| {name} | {t.steps} | {embedding} | {label} |")
        return "\n".join(lines)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"
