"""PyTorch's CPU flash attention kernels written as math, so that ONNX Runtime can run them.

Capture keeps ``scaled_dot_product_attention`` as PyTorch's flash kernel
(``_scaled_dot_product_flash_attention_for_cpu``, which returns the output and one log-sum-exp a
row, and its backward, which reads that log-sum-exp instead of the probabilities): where PyTorch
runs the graph, attention is eager's own kernel. Where ONNX Runtime runs it (small attention, see
:mod:`ortrain.runtime.torch_native_ops`), each flash node is replaced, before export, by the trace
of the functions below: the same results from matrix products, ``exp`` and a row sum, which every
exporter translates. torch.onnx's own translation of the forward cannot be used: it runs the math
attention and returns zeros for the log-sum-exp, so a backward reading them computes wrong
gradients.

Conventions of PyTorch's CPU kernels that the math follows (checked in
``tests/export/test_flash_attention_math.py`` against the kernels themselves):

- ``is_causal`` masks a key after the query's own position, counted from the top left (query
  ``i`` sees keys ``0..i``) also when there are more keys than queries;
- a float ``attn_mask`` is added to the scores; a row that it masks whole gets the output 0, the
  log-sum-exp 0 and no gradient;
- the log-sum-exp is in the accumulating dtype (float32 for 16-bit and float32 inputs, float64
  for float64: until wave 46 it was float32 always, and every float64 model's attention was
  refused as a dtype mismatch), and the products run in float32 for 16-bit inputs, as the kernel
  accumulates;
- grouped keys and values (``enable_gqa``: fewer key heads than query heads, a divisor of them)
  serve query head ``h`` with key head ``h // group``; the backward sums each group's gradients.
"""

from __future__ import annotations

import math
from typing import Any

import torch

aten = torch.ops.aten


class NoMathForm(RuntimeError):
    """A flash node that must stay in PyTorch's kernel reached an export."""


FLASH_FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _scores(
    query: torch.Tensor,
    key: torch.Tensor,
    is_causal: bool,
    attn_mask: torch.Tensor | None,
    scale: float | None,
) -> tuple[torch.Tensor, float]:
    """Scaled scores (float32 for 16-bit inputs) with the masks applied, and the scale used."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    accumulate = torch.promote_types(query.dtype, torch.float32)
    scores = torch.matmul(query.to(accumulate), key.to(accumulate).transpose(-2, -1)) * scale
    if is_causal:
        # Added as a (rows x columns) mask of 0 and -inf, not filled in with masked_fill: ONNX
        # Runtime's broadcasting Where is one element at a time (276 µs on [8, 4, 128, 128] against
        # 33 µs for Add, 2-core AMD EPYC), and the tiny GPT ran eight of them a step. The same
        # scores wherever they are finite (x + 0 = x, x + -inf = -inf); a masked score that is
        # NaN or +inf gives NaN where masked_fill gives -inf. A NaN or infinite query or key makes
        # an unmasked score of its row or column non-finite too (eager's loss is NaN then); left
        # is a product of finite vectors overflowing float32 at a masked position only.
        rows, columns = scores.shape[-2], scores.shape[-1]
        allowed = torch.ones(rows, columns, dtype=torch.bool, device=scores.device).tril()
        hidden = torch.zeros(rows, columns, dtype=scores.dtype, device=scores.device)
        scores = scores + hidden.masked_fill(allowed.logical_not(), float("-inf"))
    if attn_mask is not None:
        scores = scores + attn_mask.to(accumulate)
    return scores, scale


def _grouped(tensor: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Key or value heads repeated for the query heads each serves (as ``repeat_interleave``)."""
    batch, heads, length, width = tensor.shape
    group = query.shape[1] // heads
    if group == 1:
        return tensor
    return tensor.unsqueeze(2).expand(batch, heads, group, length, width).reshape(batch, -1, length, width)


def _summed_over_groups(gradient: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The gradient of grouped key or value heads: each head's, summed over the queries it served."""
    batch, heads, length, width = like.shape
    if gradient.shape[1] == heads:
        return gradient
    return gradient.reshape(batch, heads, -1, length, width).sum(dim=2)


def _probabilities(scores: torch.Tensor, logsumexp: torch.Tensor, masked: bool) -> torch.Tensor:
    if masked:  # a row masked whole has the log-sum-exp -inf: the kernel makes it 0
        logsumexp = torch.where(torch.isneginf(logsumexp), 0.0, logsumexp)
    return torch.exp(scores - logsumexp.unsqueeze(-1))


def flash_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, logsumexp)`` as ``_scaled_dot_product_flash_attention_for_cpu`` returns them."""
    if dropout_p != 0.0:
        raise ValueError("the CPU flash kernel has no dropout; the math form does not either")
    key, value = _grouped(key, query), _grouped(value, query)
    scores, _ = _scores(query, key, is_causal, attn_mask, scale)
    # Normalized by each row's sum, as the kernel's forward does, not as exp(scores - logsumexp):
    # a row that a float mask hides whole with finfo.min (Hugging Face's convention) has scores of
    # about -3.4e38, where adding log(n) to the log-sum-exp rounds away, and exp(scores - lse) gave
    # every key the probability 1: the output was the sum of the values where eager averages them
    # (wave 41). A row masked with -inf has the maximum -inf: 0 there, and an output of 0.
    row_max = scores.amax(dim=-1)
    row_max = torch.where(torch.isneginf(row_max), 0.0, row_max)  # selections over rows, not scores
    weights = torch.exp(scores - row_max.unsqueeze(-1))
    total = weights.sum(dim=-1)
    probabilities = weights / torch.where(total == 0, 1.0, total).unsqueeze(-1)
    output = torch.matmul(probabilities, value.to(scores.dtype)).to(query.dtype)
    logsumexp = torch.log(total) + row_max
    if attn_mask is not None:
        logsumexp = torch.where(torch.isneginf(logsumexp), 0.0, logsumexp)
    return output, logsumexp.to(torch.promote_types(query.dtype, torch.float32))


def flash_attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of query, key and value, from the forward's output and log-sum-exp (the
    probabilities are rebuilt from the scores, never stored)."""
    if dropout_p != 0.0:
        raise ValueError("the CPU flash kernel has no dropout; the math form does not either")
    grouped_key, grouped_value = key, value
    key, value = _grouped(key, query), _grouped(value, query)
    scores, scale = _scores(query, key, is_causal, attn_mask, scale)
    probabilities = _probabilities(scores, logsumexp.to(scores.dtype), attn_mask is not None)
    grad_out = grad_out.to(scores.dtype)
    grad_value = torch.matmul(probabilities.transpose(-2, -1), grad_out)
    grad_probabilities = torch.matmul(grad_out, value.to(scores.dtype).transpose(-2, -1))
    # softmax's backward: each row's gradient minus its dot product with the probabilities, which
    # equals the output's dot product with the output gradient (one value a row, no seq x seq sum).
    row_dot = (grad_out * out.to(scores.dtype)).sum(dim=-1, keepdim=True)
    grad_scores = probabilities * (grad_probabilities - row_dot) * scale
    grad_query = torch.matmul(grad_scores, key.to(scores.dtype))
    grad_key = torch.matmul(grad_scores.transpose(-2, -1), query.to(scores.dtype))
    grad_key = _summed_over_groups(grad_key, grouped_key)
    grad_value = _summed_over_groups(grad_value, grouped_value)
    return grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype)


MATH_FORMS: dict[Any, Any] = {
    FLASH_FORWARD: flash_attention_forward,
    FLASH_BACKWARD: flash_attention_backward,
}


def laid_out_like(values: Any, kernel_values: Any) -> Any:
    """``values`` (the math form's outputs, contiguous) in the memory layout of the kernel's outputs
    (``kernel_values``, the node's recorded values: the CPU kernels write batch x seq x heads x
    dim). Only a re-trace reads strides (torch.onnx's fallback path: a view of the output that
    the layout allows); in ONNX the two transposes cancel."""
    if isinstance(values, (tuple, list)):
        return type(values)(laid_out_like(v, k) for v, k in zip(values, kernel_values, strict=True))
    try:
        order = list(kernel_values.dim_order())
    except Exception:  # a layout that symbolic strides leave ambiguous: the values as they are
        return values
    if order == list(range(values.dim())):
        return values
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return values.permute(order).contiguous().permute(inverse)


def attention_inputs(node: torch.fx.Node) -> list[Any]:
    """The recorded values of a flash node's query, key and value (the backward's follow its
    output gradient)."""
    first = 1 if node.target is FLASH_BACKWARD else 0
    return [arg.meta.get("val") for arg in node.args[first : first + 3] if isinstance(arg, torch.fx.Node)]


def math_form_applies(node: torch.fx.Node) -> bool:
    """Whether a flash node can be replaced by its math form: no dropout, query, key and value of
    one batch, and key and value of one head count, the query's or a divisor of it (grouped heads,
    ``enable_gqa``; until wave 41 they stayed in PyTorch's kernel)."""
    if node.op != "call_function" or node.target not in MATH_FORMS:
        return False
    dropout_at = 6 if node.target is FLASH_BACKWARD else 3
    dropout = node.args[dropout_at] if len(node.args) > dropout_at else 0.0
    if dropout != 0.0:
        return False
    tensors = attention_inputs(node)
    if len(tensors) != 3 or any(not isinstance(t, torch.Tensor) or t.dim() != 4 for t in tensors):
        return False
    query, key, value = tensors
    # Sizes compared as expressions: equal symbols, not equal hints, and no guard added.
    batches = [str(t.shape[0]) for t in (query, key, value)]
    heads = [t.shape[1] for t in (query, key, value)]
    if str(heads[1]) != str(heads[2]) or len(set(batches)) != 1 or str(key.shape[-2]) != str(value.shape[-2]):
        return False
    if str(heads[0]) == str(heads[1]):
        return True
    return all(isinstance(h, int) for h in heads) and heads[1] > 0 and heads[0] % heads[1] == 0
