"""FP16_Optimizer on apex.amp-processed optimizers, against a stand-in of apex (NOT the real apex).

NVIDIA apex cannot be installed here: it is not on PyPI (the ``apex`` package there is unrelated) and
builds from GitHub sources with CUDA. So this test builds the state ``amp.initialize`` leaves on an
optimizer, with apex's attribute names (``_amp_stash.all_fp16_params``, ``all_fp32_from_fp16_params``,
``all_fp32_from_fp32_grad_stash``, ``_amp_lazy_init``, ``_post_amp_backward`` bound to a function named
``post_backward_with_master_weights``/``post_backward_no_master_weights``) and a loss scaler with
``LossScaler``'s Python-fallback semantics, written here from apex's ``_process_optimizer.py`` and
``scaler.py``. It checks that the patched ``_post_amp_backward`` produces the same master gradients,
parameter gradients and overflow verdict as that per-tensor reference. Running against the real apex
(with and without amp_C) needs a GPU machine with apex built.
"""

from __future__ import annotations

import types

import pytest
import torch

from ortrain.optim.fp16_optimizer import FP16_Optimizer


class ReferenceLossScaler:
    """apex.amp.scaler.LossScaler without amp_C: per-tensor ``float(grad.sum())`` overflow checks."""

    has_fused_kernel = False

    def __init__(self, scale: float) -> None:
        self._loss_scale = scale
        self._has_overflow = False
        self.dynamic = True

    def loss_scale(self) -> float:
        return self._loss_scale

    def _check(self, model_grad: torch.Tensor) -> bool:
        total = float(model_grad.float().sum())
        return total in (float("inf"), -float("inf")) or total != total

    def unscale(self, model_grads, master_grads, unused_scale, models_are_masters=False) -> None:
        if self._has_overflow:
            return
        for model, master in zip(model_grads, master_grads, strict=True):
            if self.dynamic and self._check(model):
                self._has_overflow = True
                return
            if master is not model:
                master.copy_(model)
            master.mul_(1.0 / self._loss_scale)

    def unscale_with_stashed(self, model_grads, stashed_master_grads, master_grads) -> None:
        if self._has_overflow:
            return
        for model, stashed, master in zip(model_grads, stashed_master_grads, master_grads, strict=True):
            if self.dynamic and self._check(model):
                self._has_overflow = True
                return
            stashed.add_(model.to(stashed.dtype), alpha=1.0 / self._loss_scale)
            master.data = stashed.data


def post_backward_with_master_weights(self, scaler) -> None:
    stash = self._amp_stash
    self._amp_lazy_init()
    fresh_src, fresh_dst, stashed_src, stashed_dst = [], [], [], []
    for fp16_param, fp32_param in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params, strict=True):
        if fp16_param.grad is None:
            continue
        if fp32_param.grad is None:
            fp32_param.grad = torch.empty_like(fp32_param)
            fresh_src.append(fp16_param.grad)
            fresh_dst.append(fp32_param.grad)
        else:
            stashed_src.append(fp16_param.grad)
            stashed_dst.append(fp32_param.grad)
    if fresh_src:
        scaler.unscale(fresh_src, fresh_dst, scaler.loss_scale())
    if stashed_src:
        scaler.unscale_with_stashed(stashed_src, stashed_dst, stashed_dst)
    _reference_models_are_masters(
        scaler, stash.all_fp32_from_fp32_params, stash.all_fp32_from_fp32_grad_stash
    )


def _reference_models_are_masters(scaler, params, stashed_grads) -> None:
    plain, with_stash, stashed = [], [], []
    for param, stashed_grad in zip(params, stashed_grads, strict=True):
        if param.grad is None and stashed_grad is not None:
            param.grad = stashed_grad
        elif param.grad is not None and stashed_grad is None:
            plain.append(param.grad)
        elif param.grad is not None and stashed_grad is not None:
            with_stash.append(param.grad)
            stashed.append(stashed_grad)
    if plain:
        scaler.unscale(plain, plain, scaler.loss_scale(), models_are_masters=True)
    if with_stash:
        scaler.unscale_with_stashed(with_stash, stashed, with_stash)
    for i in range(len(stashed_grads)):
        stashed_grads[i] = None


def _amp_optimizer(seed: int, *, bad: float | None, accumulate: bool) -> tuple[torch.optim.Optimizer, list]:
    """An SGD optimizer in the state apex O2 leaves it: fp32 masters of fp16 params, plus one fp32 param."""
    gen = torch.Generator().manual_seed(seed)
    fp16 = [torch.randn(n, generator=gen).half().requires_grad_() for n in (5, 17, 3)]
    masters = [p.detach().float().requires_grad_() for p in fp16]
    fp32 = [torch.randn(4, generator=gen).requires_grad_()]
    opt = torch.optim.SGD([*masters, *fp32], lr=0.1)
    stash = types.SimpleNamespace(
        all_fp16_params=fp16,
        all_fp32_from_fp16_params=masters,
        all_fp32_from_fp32_params=fp32,
        all_fp32_from_fp32_grad_stash=[None],
    )
    opt._amp_stash = stash
    opt._amp_lazy_init = types.MethodType(lambda self: None, opt)
    opt._post_amp_backward = types.MethodType(post_backward_with_master_weights, opt)
    for p in fp16:
        p.grad = (torch.randn(p.shape, generator=gen) * 100).half()
    fp32[0].grad = torch.randn(4, generator=gen) * 100
    if accumulate:  # gradient accumulation: master grads and the fp32 stash already hold values
        masters[0].grad = torch.randn(5, generator=gen)
        stash.all_fp32_from_fp32_grad_stash[0] = torch.randn(4, generator=gen)
    if bad is not None:
        fp16[1].grad[4] = bad
    return opt, [*masters, *fp32]


@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")])
@pytest.mark.parametrize("accumulate", [False, True])
def test_patched_post_amp_backward_matches_apex_reference(bad: float | None, accumulate: bool) -> None:
    ref_opt, ref_params = _amp_optimizer(0, bad=bad, accumulate=accumulate)
    opt, params = _amp_optimizer(0, bad=bad, accumulate=accumulate)
    assert FP16_Optimizer(opt) is opt
    assert opt._post_amp_backward.__func__ is not post_backward_with_master_weights
    ref_scaler, scaler = ReferenceLossScaler(128.0), ReferenceLossScaler(128.0)
    ref_opt._post_amp_backward(ref_scaler)
    opt._post_amp_backward(scaler)
    assert scaler._has_overflow == ref_scaler._has_overflow == (bad is not None)
    assert opt._amp_stash.all_fp32_from_fp32_grad_stash == [None]
    if bad is None:  # after an overflow apex's gradients are garbage either way and the step is skipped
        for p, r in zip(params, ref_params, strict=True):
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-7)


def test_fused_kernel_scaler_gets_flag_in_overflow_buffer() -> None:
    """With amp_C, apex reads ``_overflow_buf`` once in update_scale; the patch must write it, not sync."""
    opt, _ = _amp_optimizer(0, bad=float("inf"), accumulate=False)
    FP16_Optimizer(opt)
    scaler = ReferenceLossScaler(128.0)
    type(scaler).has_fused_kernel = True
    try:
        scaler._overflow_buf = torch.zeros(1, dtype=torch.int32)
        opt._post_amp_backward(scaler)
    finally:
        type(scaler).has_fused_kernel = False
    assert scaler._overflow_buf.item() == 1
    assert scaler._has_overflow is False


def test_unknown_post_backward_variant_is_left_alone() -> None:
    opt, _ = _amp_optimizer(0, bad=None, accumulate=False)

    def post_backward_with_master_weights_FusedAdam(self, scaler) -> None:
        return None

    original = types.MethodType(post_backward_with_master_weights_FusedAdam, opt)
    opt._post_amp_backward = original
    assert FP16_Optimizer(opt) is opt
    assert opt._post_amp_backward == original
