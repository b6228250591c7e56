"""``torch.as_strided`` / ``as_strided_scatter`` on tensors whose memory is not in logical order."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from ortrain import ORTModule
from ortrain.ortmodule import ORTModuleTorchModelException


class _Net(nn.Module):
    def __init__(self, body: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.linear(x)).square().sum()


BODIES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    # A transposed view: as_strided indexes the memory of the linear layer's output.
    "transposed": lambda h: torch.as_strided(h.t(), (4, 2), (1, 4)),
    # A layout-preserving elementwise result of a transposed view is transposed in memory too.
    "elementwise of transposed": lambda h: (h.t() * 2).as_strided((3, 3), (2, 5), 1),
    # A slice of whole rows starts at an offset; the call addresses within it. (After a cumsum
    # over rows: the compute optimizer would move a slice of the linear layer's output above it.)
    "row slice at an offset": lambda h: torch.as_strided(h.cumsum(0)[2:6], (2, 4), (8, 1), 16 + 3),
    # Overlapping windows: the gradient sums over the elements read twice.
    "overlapping": lambda h: torch.as_strided(h.t(), (3, 3), (1, 1)),
    # Eager PyTorch scatters into a non-contiguous tensor only where it needs no gradient.
    "scatter into transposed": lambda h: (
        torch.as_strided_scatter(h.detach().t() * 3, torch.ones(2, 2), (2, 2), (1, 8), 3) * h.t()
    ),
}


@pytest.mark.parametrize("tuning", ["0", "automatic"])
@pytest.mark.parametrize("body", list(BODIES))
def test_as_strided_matches_eager_in_every_placement(
    monkeypatch: pytest.MonkeyPatch, calls_like_eager: Callable[..., None], body: str, tuning: str
) -> None:
    """ONNX Runtime's tensors are contiguous and its as_strided indexes values in logical order:
    the transposed case computed 2.28 where eager computes 6.01, in ONNX Runtime's placement only."""
    if tuning == "automatic":  # the first calls run PyTorch's placement, later ONNX Runtime's
        monkeypatch.delenv("ORTMODULE_ENABLE_TUNING", raising=False)
        monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY", raising=False)  # else ONNX Runtime's leads
    else:
        monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    eager = _Net(BODIES[body])
    # The automatic tuner switches placements in these calls.
    calls_like_eager(eager, ORTModule(copy.deepcopy(eager)), [torch.randn(8, 8)] * 4)


def _past_the_slice(h: torch.Tensor) -> torch.Tensor:
    return torch.as_strided(h[:2], (4, 8), (8, 1))  # rows 2 and 3 are the original tensor's


def test_memory_outside_the_tensor_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    model = ORTModule(_Net(_past_the_slice))
    with pytest.raises(
        ORTModuleTorchModelException, match=r"torch.as_strided reaches memory outside.*\.contiguous\(\)"
    ):
        model(torch.randn(8, 8))


def test_memory_outside_the_tensor_trains_in_pytorch_by_default(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY", raising=False)  # the default policy
    torch.manual_seed(0)
    eager = _Net(_past_the_slice)
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(8, 8)
    with caplog.at_level("WARNING", logger="ortrain"):
        torch.testing.assert_close(wrapped(x), eager(x))
    assert "as_strided reaches memory outside" in caplog.text


def _overlapping_chunks(x: torch.Tensor) -> torch.Tensor:
    """Longformer's ``_chunk``: windows that overlap by half, read from the tensor's memory."""
    size, stride = list(x.size()), list(x.stride())
    size[1], stride[1] = size[1] * 2 - 1, stride[1] // 2
    return x.as_strided(size, stride)


def test_an_output_viewing_an_input_keeps_its_strides_at_a_new_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wave 23: AOTAutograd makes such an output again from the input with the strides of what the
    graph returned; ONNX Runtime's contiguous copy read past the input's storage once a second
    size made the graph dynamic ("setStorage: ... out of bounds")."""
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY", raising=False)  # sym_stride runs in PyTorch
    torch._dynamo.reset()
    compiled = torch.compile(_overlapping_chunks, backend="ortrain")
    for chunks in (5, 7, 9):
        x = torch.randn(2, chunks, 4, 1)
        got = compiled(x)
        assert got.stride() == _overlapping_chunks(x).stride()
        torch.testing.assert_close(got, _overlapping_chunks(x))


def test_as_strided_with_sizes_from_values_on_a_contiguous_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """A size that is a 0-d tensor (Longformer's chunk count, ``torch.div(seq, w)``) cannot be
    checked against the tensor's end at capture; on a contiguous tensor the call reads its values
    in logical order in every executor, and is no longer refused (wave 23: Longformer's attention
    layer was refused by name)."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")

    def windows(h: torch.Tensor) -> torch.Tensor:
        count = torch.div(h.size(1), 2, rounding_mode="trunc") - 1
        return h.contiguous().as_strided((h.size(0), count, 4), (h.size(1), 2, 1))

    torch.manual_seed(0)
    eager = _Net(windows)
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(3, 8)
    torch.testing.assert_close(wrapped(x), eager(x))


def _scores_into(scores: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
    """Longformer's diagonal scores: written into a tensor made before a graph break, returned as
    a transposed view of it."""
    scores[:, :, :, 2:] = chunks[:, :, :, :3]
    return scores.view(2, 4, scores.shape[1], 5).transpose(2, 1)


def test_an_output_viewing_a_written_input_is_remade_in_its_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wave 23: AOTAutograd remade the transposed view from the written input with the strides of
    ONNX Runtime's contiguous result once sizes were symbolic: the values in the wrong places
    (Longformer's masks), without an error."""
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY", raising=False)
    torch._dynamo.reset()
    compiled = torch.compile(_scores_into, backend="ortrain")
    for length in (16, 20, 24):
        chunks = torch.randn(8, length, 1, 5)
        want = _scores_into(torch.zeros(8, length, 1, 5), chunks)
        got = compiled(torch.zeros(8, length, 1, 5), chunks)
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want)
