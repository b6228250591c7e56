"""Data-dependent Python: each model trains with eager parity under ORTModule (which switches to
graph breaks after its whole-graph capture fails) and under torch.compile(backend="ortrain")."""

from __future__ import annotations

import copy
import functools
import gc
import importlib.metadata
import logging
import random
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
import torch
from _compile_parity import count_dynamo_graphs, train_compiled_side_by_side
from _parity import assert_same_state, train_side_by_side
from torch import nn
from torch.nn import functional as F

from ortrain import DebugOptions, LogLevel, ORTModule

# ORTModule's graph-break path and the torch.compile backend export the same subgraphs.
pytestmark = pytest.mark.usefixtures("shared_export_cache")

STEPS = 4


class ItemControlFlow(nn.Module):
    """A Python ``if`` on ``.item()``: both branches are taken across the batches."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if h.mean().item() > 0:
            h = h * 2.0
        else:
            h = h - 1.0
        return self.b(h)


class DataDependentSize(nn.Module):
    """Rows selected by a boolean mask: the batch size of the second layer depends on values."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        kept = h[x[:, 0] > 0]
        return self.b(kept).sum(0) / x.shape[0]


class ToListLengths(nn.Module):
    """Variable-length segments split by ``lengths.tolist()`` (CTC/packing bookkeeping)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        pooled = torch.stack([seg.mean(0) for seg in torch.split(h, lengths.tolist())])
        return self.b(pooled)


def _item_batches() -> list:
    # Alternate the sign of the mean so that the ``if`` takes both branches.
    return [(torch.randn(6, 8) + (3.0 if step % 2 else -3.0), torch.randn(6, 4)) for step in range(STEPS)]


def _size_batches() -> list:
    return [(torch.randn(6, 8), torch.randn(4)) for _ in range(STEPS)]


def _tolist_batches() -> list:
    lengths = [[2, 4], [3, 3], [2, 4], [1, 5]]
    return [(torch.randn(6, 8), torch.tensor(lengths[s]), torch.randn(2, 4)) for s in range(STEPS)]


CASES = {
    "item": (ItemControlFlow, _item_batches, lambda m, b: F.mse_loss(m(b[0]), b[1])),
    "data_dependent_size": (DataDependentSize, _size_batches, lambda m, b: F.mse_loss(m(b[0]), b[1])),
    "tolist": (ToListLengths, _tolist_batches, lambda m, b: F.mse_loss(m(b[0], b[1]), b[2])),
}


@functools.cache
def _dynamo_graph_count(case: str) -> int:
    """Dynamo's own split of a case's training (counted once: both entry points compare with it)."""
    make, batches_fn, loss_fn = CASES[case]
    torch.manual_seed(0)
    model = make()
    return count_dynamo_graphs(model, batches_fn(), loss_fn)


@pytest.mark.parametrize("case", list(CASES))
def test_ortmodule_switches_to_graph_breaks_with_parity(case: str) -> None:
    make, batches_fn, loss_fn = CASES[case]
    torch.manual_seed(0)
    model = make()
    batches = batches_fn()
    expected_graphs = _dynamo_graph_count(case)
    assert expected_graphs >= 2  # Dynamo does split these models
    torch._dynamo.reset()
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(model, batches, loss_fn)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.tensor(losses_ort), torch.tensor(losses_eager), rtol=1e-4, atol=1e-6)
    assert_same_state(wrapped, eager)
    path = wrapped._ortrain_graph_breaks
    assert path is not None, "ORTModule did not switch to graph breaks"
    assert path.graph_count == expected_graphs  # ortrain adds no recompilation of its own
    assert len(wrapped._ortrain_graphs) == 0  # no whole-graph entry


@pytest.mark.parametrize("case", list(CASES))
def test_torch_compile_backend_with_parity(case: str) -> None:
    make, batches_fn, loss_fn = CASES[case]
    torch.manual_seed(0)
    model = make()
    batches = batches_fn()
    expected_graphs = _dynamo_graph_count(case)
    losses_ort, losses_eager, eager, backend = train_compiled_side_by_side(model, batches, loss_fn)
    torch.testing.assert_close(torch.tensor(losses_ort), torch.tensor(losses_eager), rtol=1e-4, atol=1e-6)
    assert_same_state(model, eager)
    assert backend.graphs_compiled == expected_graphs


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class ItemAndPythonRandom(ItemControlFlow):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x)
        if random.random() < 2.0:  # always: a break on Python's generator, not a branch
            h = h + 1.0
        return h


def test_graph_break_is_logged_with_its_source_line(caplog: pytest.LogCaptureFixture) -> None:
    """One INFO line per break, with its source line and the reason in a few words; TorchDynamo's
    own notices of those breaks (advice for torch.compile's users, once per process) stay unshown."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    # Dynamo shows each notice once per process: forget that any was shown.
    torch._dynamo.variables.tensor.TensorVariable._warn_capture_scalar_outputs.cache_clear()
    torch._dynamo.utils.warn_once_cache.clear()
    dynamo_log = _Records()
    logging.getLogger("torch._dynamo.variables.tensor").addHandler(dynamo_log)
    model = ORTModule(ItemAndPythonRandom(), DebugOptions(log_level=LogLevel.INFO))
    try:
        with caplog.at_level(logging.INFO, logger="ortrain"), warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("always")
            for batch in _item_batches():  # both branches, and a recompilation: still one line each
                model(batch[0]).sum().backward()
    finally:
        logging.getLogger("torch._dynamo.variables.tensor").removeHandler(dynamo_log)
        torch._dynamo.reset()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("graph break at")]
    assert len(lines) == 2
    assert f"{__file__}:" in lines[0] and "`if h.mean().item() > 0:`" in lines[0]
    assert "Unsupported Tensor.item() call" in lines[0]  # not the bytecode Dynamo stopped at
    assert "`if random.random() < 2.0:" in lines[1] and "Random.random" in lines[1]
    assert not [m for m in dynamo_log.messages if "Graph break from `Tensor.item()`" in m]
    assert not [w for w in shown if "Dynamo does not know how to trace" in str(w.message)]
    # Why the whole-graph capture gave way, in one line (torch's error goes on for pages).
    skipped = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("forward rewrites skipped")
    ]
    assert skipped and all("\n" not in m and "data-dependent" in m for m in skipped)


@functools.lru_cache
def _cached_flag() -> bool:
    return False


class CachedHelperAndItem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if _cached_flag():  # Hugging Face's is_fsdp_managed_module, on its CTC models' path
            h = h * 2
        n = int((labels > 0).sum().item())  # a graph break
        return h[:, :n].sum() if n else h.sum()


def test_dynamos_lru_cache_warning_stays_unshown_on_the_graph_break_path() -> None:
    """TorchDynamo warns torch.compile's users of "silent incorrectness" where it traces through an
    ``lru_cache``-wrapped function; Wav2Vec2ForCTC's users saw it from ORTModule (wave 46's review)."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    eager = CachedHelperAndItem()
    model = ORTModule(copy.deepcopy(eager))
    x, labels = torch.randn(3, 4), torch.tensor([1, 2, 0])
    try:
        with warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("always")
            for m in (model, eager):
                m(x, labels).backward()
    finally:
        torch._dynamo.reset()
    assert model._ortrain_graph_breaks is not None
    assert not [w for w in shown if "lru_cache" in str(w.message)], [str(w.message) for w in shown]
    torch.testing.assert_close(model.lin.weight.grad, eager.lin.weight.grad)


def test_whole_graph_capture_stays_first_choice() -> None:
    torch.manual_seed(0)
    model = ORTModule(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)))
    model(torch.randn(2, 4)).sum().backward()
    assert model._ortrain_graph_breaks is None
    assert len(model._ortrain_graphs) == 1


@pytest.mark.parametrize("imports", ["", "from ortrain import ORTModule"])
def test_compile_by_name_trains_whatever_was_imported(imports: str) -> None:
    """``torch.compile(backend="ortrain")`` in a fresh interpreter, with ortrain imported or not:
    TorchDynamo finds the backend through the entry point. It raised "duplicate name: ortrain"
    when the import it made registered the backend before TorchDynamo's own registration. After
    only ``from ortrain import ORTModule`` (nothing from ortrain.backend) the name resolves to
    ortrain's backend itself."""
    code = (
        f"import torch\n{imports}\nlinear = torch.nn.Linear(2, 2)\n"
        "compiled = torch.compile(linear, backend='ortrain')\n"
        "compiled(torch.ones(3, 2)).sum().backward()\nassert linear.weight.grad is not None\n"
        "from torch._dynamo import lookup_backend\nimport ortrain.backend as b\n"
        "assert lookup_backend('ortrain') is b.ortrain_backend\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_entry_point_names_the_backend() -> None:
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    target = pyproject["project"]["entry-points"]["torch_dynamo_backends"]["ortrain"]
    entry = importlib.metadata.EntryPoint("ortrain", target, "torch_dynamo_backends")
    from ortrain.backend import ortrain_backend

    assert entry.load() is ortrain_backend


class _Branching(nn.Module):
    """``torch.cond`` whose branches return a tensor (not a tuple), as its documentation allows."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.cond(h.sum() > 0, lambda t: t.sin(), lambda t: t.cos() * 2.0, (h,))


def test_a_capture_failing_inside_torch_cond_trains_through_graph_breaks(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AOTAutograd's whole-graph capture failed in the backward of such a ``torch.cond`` ("object
    of type 'bool' has no len()") and the model fell back to PyTorch (FALLBACK_DISABLE: raised)."""
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(0)
    batches = [
        (torch.randn(4, 6) * (1 if i % 2 else -1), torch.randn(4, 6)) for i in range(4)
    ]  # both branches
    loss_fn = lambda m, b: F.mse_loss(m(b[0]), b[1])  # noqa: E731
    with caplog.at_level(logging.INFO, logger="ortrain"):
        losses_ort, losses_eager, eager, wrapped = train_side_by_side(_Branching(), batches, loss_fn)
    torch.testing.assert_close(torch.tensor(losses_ort), torch.tensor(losses_eager), rtol=1e-5, atol=1e-6)
    assert_same_state(wrapped, eager, atol=1e-5)
    assert any("failed inside a control-flow operator" in r.getMessage() for r in caplog.records)
    assert wrapped._ortrain_graph_breaks is not None


def test_every_instance_of_a_model_class_trains_through_graph_breaks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wave 37: TorchDynamo keeps its compiled code on the model class's code objects, for every
    caller alike, and stops compiling a code object after eight entries; each ORTModule compiles
    with a backend of its own, so from the ninth ORTModule of one class on (a hyper-parameter
    search, cross-validation folds) the model ran in eager PyTorch, silently. Each ORTModule's
    entries are now its own, and are invalidated when it is collected (they held its graphs).
    (A limit of two entries here: the third ORTModule is the one past it.)"""
    from torch._dynamo.eval_frame import _get_cache_entries_for_region

    from ortrain.capture import dynamo_backend

    monkeypatch.setattr(dynamo_backend, "RECOMPILE_LIMIT", 2)
    torch._dynamo.reset()
    regions = []
    # Dynamo's config through its own patch: monkeypatch's undo left it broken for later tests.
    with torch._dynamo.config.patch(recompile_limit=2):
        for seed in range(3):
            torch.manual_seed(seed)
            model = ItemControlFlow()
            eager = copy.deepcopy(model)
            wrapped = ORTModule(model)
            x = torch.randn(4, 8)
            wrapped(x).sum().backward()
            eager(x).sum().backward()
            path = wrapped._ortrain_graph_breaks
            assert path is not None and path.graph_count >= 2, f"ORTModule {seed} trained in PyTorch"
            assert_same_state(wrapped, eager)
            for ours, theirs in zip(wrapped.parameters(), eager.parameters(), strict=True):
                torch.testing.assert_close(ours.grad, theirs.grad)
            regions.append(path.compiled.dynamo_ctx._isolate_recompiles_id)
            del wrapped, model, path
            gc.collect()
    for region in regions:
        entries = _get_cache_entries_for_region(ItemControlFlow.forward, region)
        assert entries and all(entry.code is None for entry in entries)
    torch._dynamo.reset()


def test_a_global_module_hook_registered_later_runs_on_the_graph_break_path() -> None:
    """TorchDynamo does not guard global module hooks: until wave 42 one registered after the model
    went to graph breaks never ran (losses and gradients of the model without it, silently)."""
    torch.manual_seed(0)
    model = ItemControlFlow()
    wrapped = ORTModule(copy.deepcopy(model))
    batches = _item_batches()
    x = batches[0][0]
    torch.testing.assert_close(wrapped(x), model(x))  # on the graph-break path from here
    assert wrapped._ortrain_graph_breaks is not None

    def doubled(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor | None:
        return output * 2 if isinstance(module, nn.Linear) else None

    handle = torch.nn.modules.module.register_module_forward_hook(doubled)
    try:
        for x, _ in batches:
            want, got = model(x), wrapped(x)
            torch.testing.assert_close(got, want)
            want.square().sum().backward()
            got.square().sum().backward()
        for p, q in zip(model.parameters(), wrapped.module.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5)
    finally:
        handle.remove()
    x = batches[1][0]
    torch.testing.assert_close(wrapped(x), model(x))  # removed: gone from the graphs too


class _SparsePaddedEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 8, sparse=True, padding_idx=0)
        self.head = nn.Linear(8, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids).mean(1))


def test_eager_regions_of_the_graph_break_path_obey_the_fallback_policy(monkeypatch, caplog) -> None:
    """A TorchDynamo graph ortrain cannot capture runs in eager PyTorch: one warning under the
    default policy; under FALLBACK_DISABLE an error at every call (a warning until wave 42)."""
    ids = torch.randint(0, 20, (4, 5))
    wrapped = ORTModule(_SparsePaddedEmbedding())
    for _ in range(2):
        with pytest.raises(Exception, match="FALLBACK_UNSUPPORTED_TORCH_MODEL") as error:
            wrapped(ids)
        assert "could not capture TorchDynamo's graph" in str(error.value)
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    caplog.clear()
    torch.manual_seed(0)
    model = _SparsePaddedEmbedding()
    wrapped = ORTModule(copy.deepcopy(model))
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        for _ in range(2):
            torch.testing.assert_close(wrapped(ids), model(ids))
    assert len([r for r in caplog.records if "could not capture" in r.getMessage()]) == 1


class _TransposesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.t_()  # (3, n) -> (n, 3), the caller's tensor too
        return self.linear(x)


def test_a_forward_changing_its_inputs_shape_in_place_trains_through_graph_breaks() -> None:
    """Until wave 42 the caller's tensor came back with the new shape over contiguous strides
    (values scrambled) and every backward failed on a version counter."""
    torch.manual_seed(0)
    model = _TransposesItsInput()
    wrapped = ORTModule(copy.deepcopy(model))
    for step, n in enumerate((4, 4, 5)):
        given_eager = torch.arange(3.0 * n).view(3, n) + step
        given_ort = given_eager.clone()
        want, got = model(given_eager), wrapped(given_ort)
        torch.testing.assert_close(got, want)
        assert given_ort.shape == given_eager.shape and given_ort.stride() == given_eager.stride()
        torch.testing.assert_close(given_ort, given_eager)
        want.square().sum().backward()
        got.square().sum().backward()
        torch.testing.assert_close(wrapped.linear.weight.grad, model.linear.weight.grad)
    assert wrapped._ortrain_graph_breaks is not None


def test_the_backends_debug_options_set_the_log_level() -> None:
    """Until wave 42 only ORTModule set the level: ``OrtrainBackend(DebugOptions(log_level=...))``
    and ``ORTMODULE_LOG_LEVEL`` did nothing on the torch.compile path."""
    from ortrain.backend import OrtrainBackend

    root = logging.getLogger("ortrain")
    before = root.level
    try:
        OrtrainBackend(DebugOptions(log_level=LogLevel.INFO))
        assert root.level == logging.INFO
        OrtrainBackend(DebugOptions(log_level=LogLevel.ERROR))
        assert root.level == logging.ERROR
    finally:
        root.setLevel(before)


class _RolledBy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, shift: int) -> torch.Tensor:
        return self.linear(x).roll(shift, 1)


def test_roll_by_a_changing_int_trains_through_the_backend() -> None:
    """TorchDynamo makes the changing shift a symbol, which onnxscript's translation of ``roll``
    takes as an attribute: until wave 42 the region ran in PyTorch (and FALLBACK_DISABLE raised)."""
    torch.manual_seed(0)
    model = _RolledBy()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="ortrain")
    try:
        for shift in (1, 2, 3):
            x = torch.randn(4, 16)
            got, want = compiled(x, shift), eager(x, shift)
            torch.testing.assert_close(got, want)
            got.square().mean().backward()
            want.square().mean().backward()
            torch.testing.assert_close(model.linear.weight.grad, eager.linear.weight.grad)
    finally:
        torch._dynamo.reset()


class _Flagged(ItemControlFlow):
    def forward(self, x: torch.Tensor, scale: bool = False, shift: bool = False) -> torch.Tensor:
        h = super().forward(x)
        return (h * 3 if scale else h) + (1 if shift else 0)


def test_modes_past_dynamos_recompile_limit_run_in_ortrain_or_are_named(monkeypatch) -> None:
    """Each train/eval, grad mode and flag argument is a TorchDynamo entry of the forward: past
    its limit of 8 a Hugging Face model's evaluation calls ran in eager PyTorch with only
    TorchDynamo's warning (wave 43). ortrain's limit is 64, and reaching it is an eager region:
    one warning of ortrain's, an error under FALLBACK_DISABLE."""
    from ortrain.capture import dynamo_backend

    torch.manual_seed(0)
    model = _Flagged()
    wrapped = ORTModule(copy.deepcopy(model))
    modes = [
        (t, g, s, h)
        for t in (True, False)
        for g in (True, False)
        for s in (False, True)
        for h in (False, True)
    ]
    x = torch.randn(4, 8)

    def call_in(mode: tuple[bool, ...], m: nn.Module) -> torch.Tensor:
        m.train(mode[0])
        with torch.set_grad_enabled(mode[1]):
            return m(x, scale=mode[2], shift=mode[3])

    for mode in modes:  # 16 entries: past TorchDynamo's default limit, within ortrain's
        torch.testing.assert_close(call_in(mode, wrapped), call_in(mode, model))
    assert not wrapped._ortrain_graph_breaks.eager_regions

    monkeypatch.setattr(dynamo_backend, "RECOMPILE_LIMIT", 2)
    wrapped = ORTModule(copy.deepcopy(model))
    dynamo_log = logging.getLogger("torch._dynamo.convert_frame")
    level = dynamo_log.level
    dynamo_log.setLevel(logging.ERROR)  # TorchDynamo's logs quieted: ortrain still hears the limit
    try:
        with torch._dynamo.config.patch(recompile_limit=2), pytest.raises(Exception, match="recompile_limit"):
            for mode in modes[:4]:
                call_in(mode, wrapped)
    finally:
        dynamo_log.setLevel(level)


class _TwoLossesWithABreak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.h = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.a(x))
        if h.sum().item() > -1e9:  # data-dependent Python: the graph-break path
            h = h * 1.5
        return self.h(h), h.pow(2).mean()


def test_a_retained_graph_on_the_graph_break_path_runs_its_backward_again() -> None:
    """AOTAutograd donated saved tensors to the backward of Dynamo's graphs, and refused
    `retain_graph=True` from the first dynamic recompile on ("compiled with non-empty donated
    buffers"), until wave 44; the whole-graph capture already allowed it."""
    torch.manual_seed(0)
    eager = _TwoLossesWithABreak()
    wrapped = ORTModule(copy.deepcopy(eager))
    for rows in (4, 4, 5):
        x = torch.randn(rows, 8)
        for model in (eager, wrapped):
            model.zero_grad()
            out, aux = model(x)
            out.pow(2).mean().backward(retain_graph=True)
            aux.backward()
        for got, expected in zip(wrapped.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(got.grad, expected.grad, rtol=1e-5, atol=1e-7)
    assert wrapped._ortrain_graph_breaks is not None


class _MaskedRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.arange(40.0).reshape(10, 4))

    def forward(self, mask: torch.Tensor) -> torch.Tensor:
        return (self.w * 2)[mask]  # a size from values: the graph-break path


def test_dynamos_own_trace_failure_obeys_the_fallback_policy(monkeypatch, caplog) -> None:
    """A uint8 mask after a bool one: TorchDynamo's fake tensors refuse it ("tensors used as indices
    must be long, int, byte or bool"), where eager indexes with it; until wave 47 Dynamo's error
    reached the user under every policy."""
    bool_mask = torch.arange(10) % 3 == 0
    byte_mask = bool_mask.to(torch.uint8)
    eager = _MaskedRows()
    wrapped = ORTModule(copy.deepcopy(eager))
    wrapped(bool_mask)
    with pytest.raises(Exception, match="TorchDynamo failed to trace the forward"):
        wrapped(byte_mask)
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    wrapped = ORTModule(copy.deepcopy(eager))
    wrapped(bool_mask)
    with caplog.at_level(logging.WARNING, logger="ortrain"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch's deprecation of uint8 masks
        got, expected = wrapped(byte_mask), eager(byte_mask)
    torch.testing.assert_close(got, expected)
    assert any("TorchDynamo failed to trace" in r.getMessage() for r in caplog.records)


class _CountsItsCalls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return (self.fc(x) / self.calls).pow(2).mean()


def test_a_counter_on_the_model_compiles_once_not_per_step() -> None:
    """Wave 47's review: TorchDynamo specialized the int attribute, so each step compiled a graph
    (0.3-0.6 s a step for a 4x4 Linear) until its recompile limit, where FALLBACK_DISABLE raised."""
    torch.manual_seed(0)
    eager = _CountsItsCalls()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(2, 4)
    for _ in range(12):
        expected, got = eager(x), wrapped(x)
        torch.testing.assert_close(got, expected)
        expected.backward()
        got.backward()
    torch.testing.assert_close(wrapped.fc.weight.grad, eager.fc.weight.grad)
    assert wrapped.module.calls == eager.calls == 12
    assert wrapped._ortrain_graph_breaks.graph_count <= 3


class _SelectsRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        h = self.fc(x)
        h = h[h.sum(-1) > -100]  # a size from values: the graph-break path
        if extra is not None:
            h = h @ extra
        return h.pow(2).mean()


def test_a_users_error_on_the_graph_break_path_is_eagers_and_keeps_the_graphs(monkeypatch) -> None:
    """A bad batch that TorchDynamo's fake tensors refuse: eager refuses it too, so eager's error is
    the user's, and the model keeps training on its graphs (the review of wave 47's diff: the
    fallback policy sent it to PyTorch for good)."""
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    torch.manual_seed(0)
    eager = _SelectsRows()
    wrapped = ORTModule(copy.deepcopy(eager))
    wrapped(torch.randn(3, 4)).backward()
    wrapped(torch.randn(5, 4)).backward()
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        wrapped(torch.randn(3, 4), torch.randn(5, 2))  # the wrong shape
    x = torch.randn(6, 4)
    torch.testing.assert_close(wrapped(x), eager(x))
    assert not wrapped._ortrain_fallback.active


def test_batched_gradients_on_the_graph_break_path_say_what_to_do() -> None:
    """Wave 49's review: vmap's batched gradients reached the executor, which failed with "Cannot
    access data pointer of Tensor that doesn't have storage"; one gradient per row runs."""
    torch.manual_seed(0)
    eager = ItemControlFlow().double()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(2, 8, dtype=torch.float64)
    wrapped(x).sum().backward()  # captured: the graph-break path
    with pytest.raises(RuntimeError, match=r"cannot take batched gradients.*vectorize=False"):
        torch.autograd.functional.jacobian(wrapped, x, vectorize=True)
    expected = torch.autograd.functional.jacobian(eager, x)
    torch.testing.assert_close(torch.autograd.functional.jacobian(wrapped, x), expected)
