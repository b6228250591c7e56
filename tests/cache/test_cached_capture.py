"""A warm ORTMODULE_CACHE_DIR skips the capture too: a fresh process runs the stored capture
(AOTAutograd's runtime glue rebuilt from its own cache format) and trains bit-identically."""

from __future__ import annotations

import copy
import importlib
import json
import logging
import os
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from ortrain import ORTModule
from ortrain.cache import cached_capture
from ortrain.cache.store import CacheStore
from ortrain.runtime import startup_timings

_CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch import nn
    from ortrain import ORTModule
    from ortrain.runtime import startup_timings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Linear(16, 6))
    wrapped = ORTModule(model)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    losses = []
    # Batch 4, then 7: the second capture has a symbolic batch size.
    for x in (torch.randn(4, 6), torch.randn(7, 6), torch.randn(4, 6)):
        loss = (wrapped(x) - x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    stages = [t.stage for t in startup_timings.RECORDED if t.stage.startswith("capture")]
    state = [t.tolist() for t in model.state_dict().values()]
    print(json.dumps({"losses": losses, "state": state, "stages": stages}))
    """
)


def _run_child(script: Path, cache: Path, **env: str) -> dict:
    environment = {
        **os.environ,
        "ORTMODULE_CACHE_DIR": str(cache),
        "ORTMODULE_FALLBACK_POLICY": "FALLBACK_DISABLE",
        **env,
    }
    done = subprocess.run(
        [sys.executable, str(script)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_fresh_process_skips_the_capture(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_CHILD)
    cache = tmp_path / "cache"
    cold = _run_child(script, cache)
    assert cold["stages"] == ["capture", "capture (store)"] * 2
    warm = _run_child(script, cache)
    assert warm["stages"] == ["capture (cached)"] * 2  # the static and the dynamic capture
    assert warm["losses"] == cold["losses"]  # bit-identical
    assert warm["state"] == cold["state"]  # parameters and BatchNorm's running statistics
    kinds = sorted(e.header["kind"] for e in CacheStore(cache).entries())
    assert kinds.count("capture") == 2


def _run_here(script: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    """A child's script run in this process (where a fresh interpreter would show nothing more)."""
    startup_timings.RECORDED.clear()
    runpy.run_path(str(script), run_name="__main__")
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_capture_caching_switched_off_captures_every_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text(_CHILD)
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ORTMODULE_CACHE_CAPTURE", "0")
    for _ in range(2):  # the second run finds nothing stored either
        off = _run_here(script, capsys)
        assert off["stages"] == ["capture"] * 2
    assert not [e for e in CacheStore(tmp_path / "cache").entries() if e.header["kind"] == "capture"]


class _Transposes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).transpose(0, 1)


def test_a_stored_capture_hands_its_outputs_over_in_eagers_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model, x = _Transposes(), torch.randn(6, 8)
    strides = []
    for stages in (["capture", "capture (store)"], ["capture (cached)"]):
        startup_timings.RECORDED.clear()
        strides.append(ORTModule(copy.deepcopy(model))(x).stride())
        assert [t.stage for t in startup_timings.RECORDED if t.stage.startswith("capture")] == stages
    assert strides == [(1, 8), (1, 8)]  # eager's transposed view


def test_a_capture_loaded_from_the_cache_is_logged_as_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Until wave 53 a warm run logged "capturing a graph: first call" and "capturing training
    graphs", and nothing said the capture had been loaded."""
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model, x = nn.Linear(4, 4), torch.randn(2, 4)
    logged = []
    for _ in range(2):  # cold, then warm
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ortrain.ortmodule"):
            ORTModule(copy.deepcopy(model))(x).sum().backward()
        logged.append([m for r in caplog.records if "graph" in (m := r.getMessage()) and "captur" in m])
    assert logged == [
        ["capturing a graph: first call", "capturing training graphs for 1 input"],
        ["loaded training graphs for 1 input from the cache (ORTMODULE_CACHE_DIR), not captured: first call"],
    ]


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class _WithFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Square.apply(self.fc(x))


def _train(model: nn.Module, x: torch.Tensor, steps: int = 2) -> tuple[list[float], list[str]]:
    startup_timings.RECORDED.clear()
    wrapped = ORTModule(copy.deepcopy(model))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = wrapped(x).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, [t.stage for t in startup_timings.RECORDED if t.stage.startswith("capture")]


def test_graphs_that_call_python_are_not_stored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model, x = _WithFunction(), torch.randn(3, 4)
    first = _train(model, x)
    second = _train(model, x)
    assert first[1] == second[1] == ["capture"]  # an opaque Function is a python op of that process
    assert first[0] == second[0]
    assert not [e for e in CacheStore(tmp_path).entries() if e.header["kind"] == "capture"]


def test_unreadable_and_corrupt_entries_are_captured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1), nn.Flatten(0))
    x = torch.randn(5, 4)
    reference = _train(model, x)
    store = CacheStore(tmp_path)
    (entry,) = [e for e in store.entries() if e.header["kind"] == "capture"]
    key = entry.header["key"]

    # A whole entry (its checksum matches) that this ortrain cannot read.
    store.save(cached_capture.KIND, key, b"not a pickle", {"what": "capture"})
    with caplog.at_level(logging.WARNING, logger="ortrain.cache"):
        run = _train(model, x)
    assert "cannot be read" in caplog.text and run[1] == ["capture (cached)", "capture", "capture (store)"]
    assert run[0] == reference[0]

    # A truncated entry: detected by its checksum.
    data = store.path(cached_capture.KIND, key).read_bytes()
    store.path(cached_capture.KIND, key).write_bytes(data[:-100])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ortrain.cache"):
        run = _train(model, x)
    assert "is corrupt" in caplog.text and run[1] == ["capture", "capture (store)"]
    assert _train(model, x) == (reference[0], ["capture (cached)"])


def test_a_directory_others_can_write_holds_no_captures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Loading a capture unpickles it: never from a directory someone else could have written."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(shared))
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 2), nn.Flatten(0)), torch.randn(3, 4)
    with caplog.at_level(logging.WARNING, logger="ortrain.cache"):
        first = _train(model, x)
        second = _train(model, x)
    assert caplog.text.count("can be written by other users") == 1
    assert first == second and second[1] == ["capture"]
    kinds = [e.header["kind"] for e in CacheStore(shared).entries()]
    assert "capture" not in kinds and "export" in kinds


class _KeepsItsPenalty(nn.Module):
    """Assigns a differentiable tensor to a plain attribute at every call: an extra graph output,
    set on the module after each run (ortrain/capture/attribute_assignments.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.penalty = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        self.penalty = h.abs().mean()
        return h.square()


def test_a_stored_capture_sets_the_attributes_its_forward_assigns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    model, x = _KeepsItsPenalty(), torch.randn(3, 4)
    runs = []
    for _ in range(2):  # cold, then from the stored capture
        startup_timings.RECORDED.clear()
        wrapped = ORTModule(copy.deepcopy(model))
        out = wrapped(x)
        penalty = wrapped.module.penalty
        (out.sum() + penalty).backward()
        runs.append((penalty.item(), wrapped.module.fc.weight.grad.clone()))
        runs[-1] += ([t.stage for t in startup_timings.RECORDED if t.stage.startswith("capture")],)
    eager = copy.deepcopy(model)
    out = eager(x)
    (out.sum() + eager.penalty).backward()
    assert runs[0][2] == ["capture", "capture (store)"] and runs[1][2] == ["capture (cached)"]
    for penalty, grad, _ in runs:
        assert penalty == pytest.approx(eager.penalty.item(), rel=1e-6)
        torch.testing.assert_close(grad, eager.fc.weight.grad)


_IMPORTS_IN_FORWARD_CHILD = textwrap.dedent(
    """
    import copy, json
    import torch
    from torch import nn
    from ortrain import ORTModule
    from ortrain.runtime import startup_timings

    class ImportsItsHelper(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 3)

        def forward(self, x):
            import scaled_by_helper  # first imported by the trace, after the key was computed

            return scaled_by_helper.scale(self.linear(x)).sum()

    torch.manual_seed(0)
    model, x = ImportsItsHelper(), torch.randn(2, 4)
    wrapped = ORTModule(copy.deepcopy(model))
    got = wrapped(x).item()
    stages = [t.stage for t in startup_timings.RECORDED if t.stage.startswith("capture")]
    print(json.dumps({"got": got, "expected": model(x).item(), "stages": stages}))
    """
)


def test_an_edited_file_the_forward_imports_while_traced_is_captured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The key hashes the files loaded before the trace; a module a forward imports is loaded by
    the trace. Until wave 41 an edit to it loaded the old capture (0.5 where eager scaled by 0.9).
    Run here, the helper unloaded between the runs as a new process would find it."""
    script = tmp_path / "train.py"
    script.write_text(_IMPORTS_IN_FORWARD_CHILD)
    helper = tmp_path / "scaled_by_helper.py"
    helper.write_text("def scale(h):\n    return h * 0.5\n")
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # an edit within the second: no stale .pyc
    monkeypatch.delitem(sys.modules, "scaled_by_helper", raising=False)
    cold = _run_here(script, capsys)
    assert cold["stages"] == ["capture", "capture (store)"] and cold["got"] == cold["expected"]
    helper.write_text("def scale(h):\n    return h * 0.9\n")
    del sys.modules["scaled_by_helper"]
    importlib.invalidate_caches()
    edited = _run_here(script, capsys)
    # The stored entry is found and refused (a fresh process with the same files loads it:
    # test_a_fresh_process_skips_the_capture), and the new one stored.
    assert edited["stages"] == ["capture (cached)", "capture", "capture (store)"]
    assert edited["got"] == pytest.approx(edited["expected"], rel=1e-6) and edited["got"] != cold["got"]


class _Temperature(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t = 2.0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h / self.t


_TEMPERATURE = _Temperature()  # called by the forward, held by no model


class _CallsAnUnheldModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _TEMPERATURE(self.linear(x)).sum()


def test_a_capture_calling_a_module_no_model_holds_is_not_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key on disk covers the model, not a module its forward calls from elsewhere: a stored
    capture came back with that module's old ``t`` (wave 52's review: -0.99 where eager gave -0.50)."""
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_TEMPERATURE, "t", 2.0)
    torch.manual_seed(0)
    model, x = _CallsAnUnheldModule(), torch.randn(2, 4)
    for t in (2.0, 4.0):
        _TEMPERATURE.t = t
        startup_timings.RECORDED.clear()
        got = ORTModule(copy.deepcopy(model))(x)
        assert [r.stage for r in startup_timings.RECORDED if r.stage.startswith("capture")] == ["capture"]
        torch.testing.assert_close(got, model(x))
