"""The node-by-node translation gives what torch.onnx.export gives, without torch.export."""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import onnxruntime as ort
import pytest
import torch

from ortrain import bench
from ortrain.capture.aot_capture import capture
from ortrain.export import fx_to_onnx
from ortrain.export.fx_to_onnx import ExportedGraph, export_graph


@pytest.fixture(scope="module")
def gpt(
    flat_call: Callable[[torch.nn.Module], torch.nn.Module],
) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    model, batch = bench.build_model("sft", bench.QUICK)  # LayerNorm, GELU, SDPA, ignored labels
    return flat_call(model), batch


def _export(gm: torch.fx.GraphModule, *, direct: bool, monkeypatch: pytest.MonkeyPatch) -> ExportedGraph:
    monkeypatch.setattr(fx_to_onnx, "DIRECT_TRANSLATION", direct)
    before = dict(fx_to_onnx.TRANSLATIONS)
    exported = export_graph(gm, opset_version=18)
    took = {k: v - before.get(k, 0) for k, v in fx_to_onnx.TRANSLATIONS.items() if v != before.get(k, 0)}
    assert took == ({"direct": 1} if direct else {}), took
    return exported


def _run(exported: ExportedGraph, args: list[torch.Tensor]) -> list[np.ndarray]:
    session = ort.InferenceSession(exported.model.SerializeToString(), providers=["CPUExecutionProvider"])
    inputs = zip(session.get_inputs(), exported.input_positions, strict=True)
    feeds = {i.name: args[position].detach().numpy() for i, position in inputs}
    return session.run(None, feeds)


def test_forward_and_backward_match_torch_onnx_export(gpt, monkeypatch: pytest.MonkeyPatch) -> None:
    module, batch = gpt
    captured = capture(module, list(batch), training=True)
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    forward_args = [state[name] for name in captured.state_names] + list(batch)
    with torch.no_grad():
        saved = captured.forward.graph(*forward_args)
    direct = _export(captured.forward.graph, direct=True, monkeypatch=monkeypatch)
    reference = _export(captured.forward.graph, direct=False, monkeypatch=monkeypatch)
    assert direct.input_positions == reference.input_positions and direct.outputs == reference.outputs
    for got, want in zip(_run(direct, forward_args), _run(reference, forward_args), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    # The backward graph holds what the plain translation lacks: layer norm, GELU, softmax, NLL
    # and embedding backwards, decomposed node by node.
    backward = captured.backward.graph
    backward_args = [*saved[1:], torch.ones(())]  # the saved tensors, then the loss's gradient
    assert len(backward_args) == sum(n.op == "placeholder" for n in backward.graph.nodes)
    direct = _export(backward, direct=True, monkeypatch=monkeypatch)
    reference = _export(backward, direct=False, monkeypatch=monkeypatch)
    assert direct.input_positions == reference.input_positions and direct.outputs == reference.outputs
    for got, want in zip(_run(direct, backward_args), _run(reference, backward_args), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_dynamic_sizes_translate_directly(gpt, monkeypatch: pytest.MonkeyPatch) -> None:
    module, (idx, targets) = gpt
    captured = capture(module, [idx, targets], training=True, dynamic_dims={0: (1,), 1: (1,)})
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    exported = _export(captured.forward.graph, direct=True, monkeypatch=monkeypatch)
    for length in (5, idx.shape[1]):
        inputs = [idx[:, :length].contiguous(), targets[:, :length].contiguous()]
        args = [state[name] for name in captured.state_names] + inputs
        with torch.no_grad():
            want = module(*inputs)[0]
        got = _run(exported, args)[0]  # the loss
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)
    _export(captured.backward.graph, direct=True, monkeypatch=monkeypatch)


def test_an_opset_below_torchlib_goes_through_torch_onnx_export(monkeypatch: pytest.MonkeyPatch) -> None:
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.GELU())
    x = torch.randn(2, 4)
    captured = capture(module, [x], training=False)
    before = fx_to_onnx.TRANSLATIONS["torch.onnx.export"]
    exported = export_graph(captured.forward.graph, opset_version=17)
    assert fx_to_onnx.TRANSLATIONS["torch.onnx.export"] == before + 1
    assert next(o.version for o in exported.model.opset_import if o.domain == "") == 17
    args = [dict(module.named_parameters())[n] for n in captured.state_names] + [x]
    np.testing.assert_allclose(_run(exported, args)[0], module(x).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_ortmodule_trains_with_direct_translations_only() -> None:
    """Label sparsity's gather of the counted rows (a data-dependent size) included, ORTModule's
    graphs never need torch.onnx.export's path, and training matches eager."""
    from ortrain import ORTModule

    model, batch = bench.build_model("sft", bench.QUICK)
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (wrapped, eager)]
    before = fx_to_onnx.TRANSLATIONS["torch.onnx.export"]
    for _ in range(2):
        losses = []
        for module, optimizer in zip((wrapped, eager), optimizers, strict=True):
            loss = module(*batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert fx_to_onnx.TRANSLATIONS["torch.onnx.export"] == before
    for (name, a), b in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_graph_whose_operators_all_translate_lists_no_decompositions(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.onnx._internal.exporter import _decomp

    from ortrain.export import exporter_decompositions

    def forbidden(_translated: object) -> dict[object, object]:
        raise AssertionError("listed torch's decompositions")

    monkeypatch.setattr(exporter_decompositions, "_TABLES", {})
    monkeypatch.setattr(_decomp, "create_onnx_friendly_decomposition_table", forbidden)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    x = torch.randn(2, 4)
    captured = capture(module, [x], training=False)
    exported = _export(captured.forward.graph, direct=True, monkeypatch=monkeypatch)
    args = [dict(module.named_parameters())[n] for n in captured.state_names] + [x]
    np.testing.assert_allclose(_run(exported, args)[0], module(x).detach().numpy(), rtol=1e-5, atol=1e-6)


class _WithAnIdentityOfOpenSize(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mixing = torch.eye(n) + torch.ones(n, n) / n  # ``eye`` decomposes from its size alone
        return (mixing @ self.proj(x)).square().mean()


def test_a_decomposition_of_sizes_alone_shares_the_graphs_fake_mode(monkeypatch) -> None:
    """``eye(n)`` at an open size was traced in a fake mode of its own, which the direct
    translation refused to mix with the graph's; the torch.onnx.export path then failed too, and
    the graph ran in PyTorch (wave 44: a GPT with a padding mask built with ``eye``)."""
    from ortrain import ORTModule

    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNING", "0")
    torch.manual_seed(0)
    eager = _WithAnIdentityOfOpenSize()
    wrapped = ORTModule(copy.deepcopy(eager))
    before = fx_to_onnx.TRANSLATIONS["torch.onnx.export"]
    for length in (5, 7, 3):
        x = torch.randn(2, length, 4)
        expected, got = eager(x), wrapped(x)
        expected.backward()
        got.backward()
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(wrapped.proj.weight.grad, eager.proj.weight.grad)
    assert fx_to_onnx.TRANSLATIONS["torch.onnx.export"] == before
