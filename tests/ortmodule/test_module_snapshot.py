"""ModuleSnapshot alone: what a capture changed in a model, named, and put back."""

from __future__ import annotations

import torch
from torch import nn

from ortrain.ortmodule.module_snapshot import ModuleSnapshot


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), nn.Dropout(0.1))
    model.steps = 0
    return model


def test_an_untouched_model_reports_nothing() -> None:
    model = _model()
    assert ModuleSnapshot(model).restore() == []


def test_every_kind_of_change_is_named_and_undone() -> None:
    model = _model()
    weight, bias, dropout = model[0].weight, model[0].bias, model[1]
    snapshot = ModuleSnapshot(model)
    model.steps = 1  # a plain attribute changed
    model.cache = torch.zeros(2)  # an attribute added
    model[0].register_buffer("seen", torch.ones(1))  # a table's contents changed
    model[0].weight = nn.Parameter(torch.zeros(3, 2))  # a parameter replaced
    del model[0].bias
    model[1] = nn.Identity()  # a submodule swapped
    model[0].register_forward_hook(lambda *args: None)
    changes = snapshot.restore()
    assert "attribute 'steps' of the model was changed" in changes
    assert "attribute 'cache' of the model was added" in changes
    assert "modules of the model changed" in changes
    tables = {"parameters of '0' changed", "buffers of '0' changed", "forward_hooks of '0' changed"}
    assert tables <= set(changes)
    assert model.steps == 0 and not hasattr(model, "cache")
    assert model[0].weight is weight and model[0].bias is bias and model[1] is dropout
    assert dict(model[0].named_buffers()) == {} and not model[0]._forward_hooks
