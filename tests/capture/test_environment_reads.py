"""A forward that reads an environment variable keeps its graphs under the values it read: another
value captures again. A captured graph held the branch of its first value (wave 49's review); then
TorchDynamo's graph breaks, which do not guard ``os.getenv`` nor ``in os.environ`` (wave 52's review)."""

from __future__ import annotations

import copy
import logging
import os

import pytest
import torch
from torch import nn

from ortrain import ORTModule

_FORMS = {
    "get": lambda: os.environ.get("ORTRAIN_TEST_HEAD", "a") == "b",
    "item": lambda: os.environ["ORTRAIN_TEST_HEAD"] == "b",
    "getenv": lambda: os.getenv("ORTRAIN_TEST_HEAD") == "b",
    "in": lambda: "ORTRAIN_TEST_HEAD_B" in os.environ,
}


class _HeadFromEnvironment(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if _FORMS[self.form]():
            h = self.b(h)
        return h.square().mean()


@pytest.mark.parametrize("form", sorted(_FORMS))
def test_an_environment_variable_flipped_between_steps_captures_the_other_branch(
    form: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    eager = _HeadFromEnvironment(form)
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(3, 4)
    with caplog.at_level(logging.INFO, logger="ortrain"):
        for head in ("a", "a", "b", "a", "b"):
            monkeypatch.setenv("ORTRAIN_TEST_HEAD", head)
            if head == "b":
                monkeypatch.setenv("ORTRAIN_TEST_HEAD_B", "1")
            else:
                monkeypatch.delenv("ORTRAIN_TEST_HEAD_B", raising=False)
            expected, got = eager(x), wrapped(x)
            torch.testing.assert_close(got, expected, msg=f"head {head}")
            expected.backward()
            got.backward()
            for (name, p), q in zip(eager.named_parameters(), wrapped.parameters(), strict=True):
                torch.testing.assert_close(q.grad, p.grad, msg=f"head {head}: {name}'s gradient")
    assert wrapped._ortrain_graph_breaks is None  # one graph per value, both kept
    assert len(wrapped._ortrain_graphs) == 2
    name = "ORTRAIN_TEST_HEAD_B" if form == "in" else "ORTRAIN_TEST_HEAD"
    before, after = (None, "'1'") if form == "in" else ("'a'", "'b'")
    reason = f"the environment variable {name} changed from {before} to {after}"
    assert f"capturing a graph: {reason}" in caplog.text
