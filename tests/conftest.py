import gc
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from torch import nn


@pytest.fixture(autouse=True)
def _no_automatic_tuning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests inspect the plan they train with; automatic op tuning would swap it mid-test for the
    placement that measures fastest on the machine. Tuning's own tests set the variable back."""
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")


@pytest.fixture
def compile_collections(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each collection of a compile's garbage (ortrain/runtime/full_collections.py) meanwhile, as
    whether the objects older than the compile were frozen when it ran (it walks the compile's own)."""
    from ortrain.runtime import full_collections

    frozen_at_collection: list[bool] = []
    collect = full_collections.collect_compile_garbage

    def recording_collect() -> int:
        frozen_at_collection.append(gc.get_freeze_count() > 0)
        return collect()

    monkeypatch.setattr(full_collections, "collect_compile_garbage", recording_collect)
    return frozen_at_collection


@pytest.fixture(scope="session")
def export_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("export_cache")


@pytest.fixture
def shared_export_cache(monkeypatch: pytest.MonkeyPatch, export_cache_dir: Path) -> None:
    """ORTMODULE_CACHE_DIR shared by the test files that opt in
    (``pytestmark = pytest.mark.usefixtures("shared_export_cache")``): files that wrap the same
    models again and again (each guard scenario starts from one model, a resumed Trainer wraps a
    new copy) export each graph once, as users who set the variable do; exporting is most of their
    time. Files that patch the exporter must not opt in. The cache's own behaviour is tested in
    tests/cache/. (The zoo gains nothing: Dynamo's graphs of its models differ from ORTModule's.)"""
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(export_cache_dir))


class TruncatingModel(nn.Module):
    """Keeps at most 16 positions: a branch on a size, which a capture with symbolic sizes decides
    once (ortrain/capture/size_guards.py)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > 16:
            x = x[:, :16]
        return self.proj(x).square().mean()


@pytest.fixture
def truncating_model() -> type[nn.Module]:
    return TruncatingModel


def _calls_like_eager(eager: nn.Module, wrapped: nn.Module, batches: Sequence[torch.Tensor]) -> None:
    """Each call of ``wrapped`` (an ORTModule of a copy of ``eager``, or its torch.compile with
    ortrain's backend) returns eager's loss and gives eager's gradients, and an ORTModule still runs
    its graphs at the end (no fallback)."""
    for x in batches:
        for model in (eager, wrapped):
            model.zero_grad()
        expected, got = eager(x), wrapped(x)
        expected.backward()
        got.backward()
        torch.testing.assert_close(got, expected)
        for p, q in zip(wrapped.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
    fallback = getattr(wrapped, "_ortrain_fallback", None)
    assert fallback is None or not fallback.active  # still on the graphs


@pytest.fixture
def calls_like_eager() -> Callable[[nn.Module, nn.Module, Sequence[torch.Tensor]], None]:
    return _calls_like_eager
