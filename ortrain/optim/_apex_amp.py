"""Multi-tensor gradient unscaling and overflow check for optimizers processed by ``apex.amp.initialize``.

apex's ``_post_amp_backward`` (``apex/amp/_process_optimizer.py``) unscales gradients through
``LossScaler.unscale``; without apex's CUDA extension (``amp_C``) that is ``scale_check_overflow_python``,
which reads ``float(grad.sum())`` on the host once per gradient. The replacement bound here does the same
bookkeeping (fresh or stashed master gradients, fp32 model params, stash cleared) but unscales with
``torch._foreach_*`` ops and checks overflow over all incoming gradients at once: with amp_C the verdict
goes into ``scaler._overflow_buf`` (read once by ``update_scale``), without it one host sync sets
``scaler._has_overflow``.

Only the generic optimizer variants are replaced (``post_backward_with_master_weights``, O2, and
``post_backward_no_master_weights``, O1/O3); apex's own FusedAdam/FusedSGD variants are left alone.
Written against apex's ``_process_optimizer.py`` and ``scaler.py`` attribute names.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch
from torch import Tensor

from ortrain.optim._multi_tensor_checks import bucket_by_device_and_dtype, nonfinite_flag

logger = logging.getLogger("ortrain.optim.apex_amp")

# apex's names of the functions it binds as ``_post_amp_backward``.
_WITH_MASTER = "post_backward_with_master_weights"
_NO_MASTER = "post_backward_no_master_weights"


def is_amp_optimizer(optimizer: Any) -> bool:
    """apex.amp keeps the optimizer's class and marks the instance with ``_amp_stash``."""
    return hasattr(optimizer, "_amp_stash")


def _foreach_by_bucket(fn: Any, *lists: list[Tensor], **kwargs: Any) -> None:
    """Applies a ``torch._foreach_*`` op to parallel lists, split where device/dtype of the first differ."""
    if not lists[0]:
        return
    keys = [tuple((t.device, t.dtype) for t in ts) for ts in zip(*lists, strict=True)]
    if len(set(keys)) == 1:
        fn(*lists, **kwargs)
        return
    groups: dict[Any, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    for idx in groups.values():
        fn(*[[lst[i] for i in idx] for lst in lists], **kwargs)


def _upcast(grads: list[Tensor]) -> list[Tensor]:
    out = [torch.empty_like(g, dtype=torch.float32) for g in grads]
    _foreach_by_bucket(torch._foreach_copy_, out, grads)
    return out


def _models_are_masters(
    scaler: Any, params: list[Tensor], stashed_grads: list[Tensor | None]
) -> list[Tensor]:
    """apex's post_backward_models_are_masters with multi-tensor math; returns the incoming gradients."""
    plain: list[Tensor] = []
    with_stash: list[Tensor] = []
    stashes: list[Tensor] = []
    owners: list[Tensor] = []
    for param, stashed in zip(params, stashed_grads, strict=True):
        if param.grad is None and stashed is not None:
            param.grad = stashed
        elif param.grad is not None and stashed is None:
            plain.append(param.grad)
        elif param.grad is not None and stashed is not None:
            with_stash.append(param.grad)
            stashes.append(stashed)
            owners.append(param)
    inv_scale = 1.0 / scaler.loss_scale()
    if not scaler._has_overflow:
        # apex skips unscaling when the scale is a static 1.0 (nothing to undo).
        if plain and not (scaler.loss_scale() == 1.0 and not scaler.dynamic):
            for grads in bucket_by_device_and_dtype(plain).values():
                torch._foreach_mul_(grads, inv_scale)
        if with_stash:
            # stashed += grad/scale, and the parameter's gradient becomes the stash (apex: .data swap).
            _foreach_by_bucket(torch._foreach_add_, stashes, _upcast(with_stash), alpha=inv_scale)
            for param, stashed in zip(owners, stashes, strict=True):
                param.grad.data = stashed.data
    for i in range(len(stashed_grads)):
        stashed_grads[i] = None
    return plain + with_stash


def _record_overflow(scaler: Any, incoming: list[Tensor]) -> None:
    if not scaler.dynamic or scaler._has_overflow or not incoming:
        return
    flag = nonfinite_flag(incoming)
    if getattr(type(scaler), "has_fused_kernel", False):
        # update_scale() reads _overflow_buf once (``.item()``) when the fused kernel is in use.
        buf = scaler._overflow_buf
        buf.copy_(torch.logical_or(buf.bool(), flag.to(buf.device)).to(buf.dtype))
    else:
        scaler._has_overflow = bool(flag)


def post_backward_with_master_weights(self: Any, scaler: Any) -> None:
    """apex O2 (fp32 master weights): fp16 model grads → unscaled fp32 master grads."""
    stash = self._amp_stash
    self._amp_lazy_init()
    fresh_src: list[Tensor] = []
    fresh_dst: list[Tensor] = []
    stashed_src: list[Tensor] = []
    stashed_dst: list[Tensor] = []
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
    if not scaler._has_overflow:
        inv_scale = 1.0 / scaler.loss_scale()
        if fresh_src:
            _foreach_by_bucket(torch._foreach_copy_, fresh_dst, fresh_src)
            _foreach_by_bucket(torch._foreach_mul_, fresh_dst, scalar=inv_scale)
        if stashed_src:
            _foreach_by_bucket(torch._foreach_add_, stashed_dst, _upcast(stashed_src), alpha=inv_scale)
    incoming = fresh_src + stashed_src
    incoming += _models_are_masters(
        scaler, stash.all_fp32_from_fp32_params, stash.all_fp32_from_fp32_grad_stash
    )
    _record_overflow(scaler, incoming)


def post_backward_no_master_weights(self: Any, scaler: Any) -> None:
    """apex O1/O3 (no master weights): model grads unscaled in place."""
    stash = self._amp_stash
    self._amp_lazy_init()
    incoming = _models_are_masters(scaler, stash.all_fp16_params, stash.all_fp16_grad_stash)
    incoming += _models_are_masters(scaler, stash.all_fp32_params, stash.all_fp32_grad_stash)
    _record_overflow(scaler, incoming)


def patch_amp_optimizer(optimizer: Any) -> bool:
    """Replace ``optimizer._post_amp_backward`` if it is one of apex's generic variants."""
    current = getattr(optimizer, "_post_amp_backward", None)
    name = getattr(getattr(current, "__func__", None), "__name__", None)
    if name == _WITH_MASTER:
        optimizer._post_amp_backward = types.MethodType(post_backward_with_master_weights, optimizer)
    elif name == _NO_MASTER:
        optimizer._post_amp_backward = types.MethodType(post_backward_no_master_weights, optimizer)
    else:
        logger.warning("apex amp optimizer with _post_amp_backward %r: left as is", name)
        return False
    logger.info("apex amp optimizer: multi-tensor %s", name)
    return True
