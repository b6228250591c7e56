"""Models compiled by torch.compile before or after wrapping: ORTModule traces the Python they run."""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable

import pytest
import torch
from _parity import assert_same_state, ort_graph_count
from torch import nn

from ortrain import ORTModule
from ortrain.ortmodule import ortmodule as ortmodule_module


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8))


def _train(model: nn.Module, steps: int = 3) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _compile_method(model: nn.Module) -> nn.Module:
    model.compile()
    return model


def _compile_submodule(model: nn.Module) -> nn.Module:
    model[2].compile()
    return model


def _submodule_replaced(model: nn.Module) -> nn.Module:
    model[2] = torch.compile(model[2])
    return model


@pytest.mark.parametrize(
    "compiled",
    [torch.compile, _compile_method, _compile_submodule, _submodule_replaced],
    ids=["torch.compile(model)", "model.compile()", "submodule.compile()", "submodule-replaced"],
)
def test_compiled_model_is_captured_and_trains_like_eager(compiled: Callable[[nn.Module], nn.Module]) -> None:
    """Wave 23: the compiled frame ran inside ortrain's trace and failed ("Attempting to use
    FunctionalTensor on its own"): every such model fell back to PyTorch."""
    torch._dynamo.utils.counters.clear()
    eager = _model()
    wrapped = ORTModule(compiled(copy.deepcopy(eager)))
    with warnings.catch_warnings():
        # ortrain's own global hooks made each compiled submodule warn at capture
        warnings.filterwarnings("error", message=r"Using `torch.compile\(module\)` when there are global")
        losses = _train(wrapped)
    expected = _train(eager)
    assert not wrapped._ortrain_fallback.active
    assert ort_graph_count(wrapped) == 1
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    for (name, got), want in zip(wrapped.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    # Captured, not compiled by Dynamo as well: torch.compile's frames never ran.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0


def test_torch_compile_around_the_wrapper_says_what_compiles(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.compile(ORTModule(model)): Dynamo traces through the wrapper and its backend compiles the
    model. The warning said "under torch.func transforms", which the user had not used."""
    monkeypatch.setattr(ortmodule_module, "_compiled_around_warned", [False])
    eager = _model()
    wrapped = ORTModule(copy.deepcopy(eager))
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        losses = _train(torch.compile(wrapped, backend="eager"))
    expected = _train(eager)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert_same_state(wrapped, eager, atol=1e-6)
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("ortrain")]
    assert len(messages) == 1, messages
    assert "torch.compile traces through ORTModule" in messages[0]
    assert 'backend="ortrain"' in messages[0]


def test_a_wrapper_nested_in_a_model_on_the_graph_break_path_hears_no_torch_compile_advice(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ortrain's own graph-break path traces the nested wrapper with TorchDynamo: the warning
    advised against a torch.compile the user never called (wave 45's review)."""
    monkeypatch.setattr(ortmodule_module, "_compiled_around_warned", [False])
    torch.manual_seed(0)
    inner = ORTModule(torch.nn.Linear(8, 8))
    eager = torch.nn.Sequential(copy.deepcopy(inner.module), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    outer = ORTModule(torch.nn.Sequential(inner, torch.nn.ReLU(), copy.deepcopy(eager[2])))
    kept: list[torch.Tensor] = []
    outer.module[1].register_forward_hook(lambda m, i, o: kept.append(o.detach()))  # a graph break
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        for rows in (4, 5):
            x = torch.randn(rows, 8)
            torch.testing.assert_close(outer(x), eager(x))
    assert len(kept) == 2
    assert not any("torch.compile traces through" in r.getMessage() for r in caplog.records)
