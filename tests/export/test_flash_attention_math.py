"""The math form of PyTorch's CPU flash attention kernels equals the kernels (output, log-sum-exp,
gradients), and an export never meets the kernel itself."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ortrain.export.direct_translation import inline_math_forms
from ortrain.export.flash_attention_math import (
    FLASH_BACKWARD,
    FLASH_FORWARD,
    flash_attention_backward,
    flash_attention_forward,
    math_form_applies,
)
from ortrain.export.fx_to_onnx import ExportError, export_graph


def _inputs(queries: int, keys: int, dtype: torch.dtype, masked: bool, kv_heads: int = 6) -> tuple:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, heads, n, 8, generator=generator).to(dtype)
        for heads, n in ((6, queries), (kv_heads, keys), (kv_heads, keys))
    )
    mask = None
    if masked:
        mask = torch.randn(queries, keys, generator=generator).to(dtype)
        mask[1] = float("-inf")  # a row masked whole: the kernel gives output 0, log-sum-exp 0
    return q, k, v, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("queries", "keys"), [(5, 7), (7, 5), (6, 6)])
@pytest.mark.parametrize("kv_heads", [6, 2, 1], ids=["heads", "grouped", "one-kv-head"])
def test_math_form_equals_the_kernels(
    queries: int, keys: int, causal: bool, masked: bool, dtype: torch.dtype, kv_heads: int
) -> None:
    q, k, v, mask = _inputs(queries, keys, dtype, masked, kv_heads)
    output, logsumexp = FLASH_FORWARD(q, k, v, 0.0, causal, attn_mask=mask, scale=0.3)
    math_output, math_logsumexp = flash_attention_forward(q, k, v, 0.0, causal, attn_mask=mask, scale=0.3)
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(math_output, output, **tolerance)
    torch.testing.assert_close(math_logsumexp, logsumexp, rtol=1e-5, atol=1e-5)
    grad_out = torch.randn(output.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    grads = FLASH_BACKWARD(grad_out, q, k, v, output, logsumexp, 0.0, causal, attn_mask=mask, scale=0.3)
    math_grads = flash_attention_backward(
        grad_out, q, k, v, output, logsumexp, 0.0, causal, attn_mask=mask, scale=0.3
    )
    for name, got, expected in zip(("query", "key", "value"), math_grads, grads, strict=True):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        torch.testing.assert_close(got, expected, **tolerance, msg=lambda m, n=name: f"grad of {n}: {m}")


def _flash_graph(dropout_p: float = 0.0, kv_heads: int = 3) -> torch.fx.GraphModule:
    q = torch.randn(2, 3, 6, 8)
    k = torch.randn(2, kv_heads, 6, 8)

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor]:
        return (FLASH_FORWARD(q, k, v, dropout_p, True)[0],)

    return make_fx(attention, tracing_mode="fake")(q, k, k.clone())


def test_inlined_math_form_leaves_no_kernel_and_computes_the_same() -> None:
    graph = _flash_graph()
    assert inline_math_forms(graph) == 1
    assert not any(n.target in (FLASH_FORWARD, FLASH_BACKWARD) for n in graph.graph.nodes)
    q, k, v = (torch.randn(2, 3, 6, 8) for _ in range(3))
    torch.testing.assert_close(graph(q, k, v)[0], FLASH_FORWARD(q, k, v, 0.0, True)[0])


def test_the_causal_mask_is_added_not_selected() -> None:
    """ONNX Runtime's broadcasting Where runs one element at a time: the exported causal attention
    adds a mask of 0 and -inf to the scores, whose values are those masked_fill gives."""
    graph = _flash_graph()
    inline_math_forms(graph)
    exported = export_graph(graph, opset_version=18).model
    ranks = {i.name: len(i.type.tensor_type.shape.dim) for i in exported.graph.value_info}
    selections = [ranks.get(n.output[0]) for n in exported.graph.node if n.op_type == "Where"]
    assert 4 not in selections  # no Where over the [batch, heads, queries, keys] scores
    q, k, v = (torch.randn(2, 3, 6, 8) for _ in range(3))
    torch.testing.assert_close(graph(q, k, v)[0], FLASH_FORWARD(q, k, v, 0.0, True)[0], rtol=0, atol=1e-6)


def test_grouped_heads_have_a_math_form() -> None:
    """Hugging Face passes ``enable_gqa`` when no mask is built (Llama, Mistral, Qwen2 with
    grouped key-value heads): the kernel reads fewer key heads than query heads."""
    graph = _flash_graph(kv_heads=1)
    (node,) = [n for n in graph.graph.nodes if n.target is FLASH_FORWARD]
    assert math_form_applies(node)
    assert inline_math_forms(graph) == 1
    q, k, v = torch.randn(2, 3, 6, 8), torch.randn(2, 1, 6, 8), torch.randn(2, 1, 6, 8)
    torch.testing.assert_close(graph(q, k, v)[0], FLASH_FORWARD(q, k, v, 0.0, True)[0])


def test_no_math_form_is_never_exported() -> None:
    """torch.onnx's translation returns a log-sum-exp of zeros: such a node must stay in PyTorch."""
    graph = _flash_graph(dropout_p=0.1)
    (node,) = [n for n in graph.graph.nodes if n.target is FLASH_FORWARD]
    assert not math_form_applies(node)
    with pytest.raises(ExportError, match="has no math form here"):
        export_graph(graph, opset_version=18)


def test_a_row_a_float_mask_hides_whole_with_the_smallest_float_averages_the_values() -> None:
    """Hugging Face masks with ``finfo.min``, not ``-inf``: a padded query's row then has scores of
    about -3.4e38, where ``exp(scores - logsumexp)`` made every probability 1 and the output the sum
    of the values (wave 41); the kernel normalizes by the row's sum and averages them."""
    q, k, v, _ = _inputs(4, 5, torch.float32, masked=False)
    mask = torch.zeros(4, 5)
    mask[1] = torch.finfo(torch.float32).min
    mask[2, 3:] = torch.finfo(torch.float32).min
    output, logsumexp = FLASH_FORWARD(q, k, v, 0.0, False, attn_mask=mask)
    math_output, math_logsumexp = flash_attention_forward(q, k, v, 0.0, False, attn_mask=mask)
    torch.testing.assert_close(math_output, output)
    torch.testing.assert_close(math_output[:, :, 1], v.mean(dim=2))
    torch.testing.assert_close(math_logsumexp, logsumexp)
    grad_out = torch.randn(output.shape, generator=torch.Generator().manual_seed(1))
    grads = FLASH_BACKWARD(grad_out, q, k, v, output, logsumexp, 0.0, False, attn_mask=mask)
    math_grads = flash_attention_backward(grad_out, q, k, v, output, logsumexp, 0.0, False, attn_mask=mask)
    for got, expected in zip(math_grads, grads, strict=True):
        torch.testing.assert_close(got, expected)
