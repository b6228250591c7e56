"""FusedAdam: a multi-tensor Adam/AdamW whose step launches a constant number of kernels.

The three weight-decay conventions (``AdamWMode``) are all mapped onto one fused Adam pass:

* on CPU (and on CUDA when Triton is unavailable or a tensor is not contiguous) onto torch's own fused
  kernels ``torch._fused_adam_`` / ``torch._fused_adamw_``, which walk every tensor of a list in C++;
* on CUDA onto the Triton multi-tensor kernel in :mod:`ortrain.optim._multi_tensor_adam_triton`.

Optimizer state (``exp_avg``, ``exp_avg_sq``) is kept in fp32 for fp16/bf16 parameters, so the math runs
in fp32 and only the parameter itself is rounded back to its dtype after each step. Keeping the second
moment in fp16 would underflow it to zero for gradients below ~2.4e-4 (their square is below fp16's
smallest subnormal), which silently turns Adam into sign-SGD with a huge step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from enum import IntEnum
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger("ortrain.optim.fused_adam")

__all__ = ["AdamWMode", "FusedAdam"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class AdamWMode(IntEnum):
    """Where weight decay enters the update (t = step, bc1 = 1 − β1ᵗ, bc2 = 1 − β2ᵗ)."""

    # g ← g + wd·p, then plain Adam (torch.optim.Adam's weight_decay).
    ADAM_L2_REGULARIZATION = 0
    # p ← p − lr·(√bc2/bc1)·m/(√v+eps), then p ← p − lr·wd·p (HuggingFace transformers' AdamW).
    ADAMW_TRANSFORMERS = 1
    # p ← p·(1 − lr·wd), then p ← p − (lr/bc1)·m/(√v/√bc2 + eps) (torch.optim.AdamW).
    ADAMW_TORCH = 2


def state_dtype_for(param_dtype: torch.dtype) -> torch.dtype:
    """Dtype of the Adam moments (and of the math) for a parameter of ``param_dtype``."""
    return torch.float32 if param_dtype in _LOW_PRECISION else param_dtype


# torch.optim.Adam's options that FusedAdam does not implement: refused, never ignored.
_UNSUPPORTED = ("amsgrad", "maximize")


class FusedAdam(torch.optim.Optimizer):
    """Adam with decoupled or L2 weight decay, updating all parameters with multi-tensor kernels.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        bias_correction: apply Adam's bias correction (otherwise bc1 = bc2 = 1).
        betas: coefficients of the running averages of the gradient and its square.
        eps: term added to the denominator.
        adam_w_mode: weight-decay convention, see :class:`AdamWMode`.
        weight_decay: weight-decay coefficient.
        set_grad_none: default of ``zero_grad``: drop gradients instead of zeroing them.

    Each parameter counts its own steps (``state[p]["step"]``), as ``torch.optim.Adam`` does: one
    whose gradient is None at a step (a head trained on every other batch, an expert no token chose,
    a layer unfrozen late in a group created with it) is not updated, and its bias correction
    counts only the steps that updated it. Until wave 31 the count was its group's, so such a
    parameter's early steps differed from torch's Adam (a layer unfrozen at the group's fifth step
    first moved 0.54× as far, with betas 0.9/0.99). ``param_group["step"]`` counts
    the steps in which any of the group's parameters had a gradient.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        adam_w_mode: AdamWMode | int = AdamWMode.ADAMW_TRANSFORMERS,
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid beta parameters: {betas}, each must be in [0, 1)")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        self.adam_w_mode = AdamWMode(adam_w_mode)
        self.set_grad_none = set_grad_none
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # The constructor's groups come through here too. A group asking for ``amsgrad`` or
        # ``maximize`` is refused as a saved state with them is (until wave 41 such a group was
        # taken, and ``maximize=True`` descended).
        unsupported = [key for key in _UNSUPPORTED if param_group.get(key)]
        if unsupported:
            raise ValueError(
                f"a parameter group with {' and '.join(f'{k}=True' for k in unsupported)}: FusedAdam "
                "does not implement it; use torch.optim.Adam / AdamW for this group's algorithm"
            )
        param_group.setdefault("step", 0)
        super().add_param_group(param_group)

    # torch.optim.Optimizer's __getstate__ keeps defaults, state and param_groups only: a copy,
    # pickle or torch.save of the optimizer lost these two, and its next step raised
    # AttributeError (wave 46's review).
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["adam_w_mode"] = self.adam_w_mode
        state["set_grad_none"] = self.set_grad_none
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # load_state_dict comes through here too, with state and param_groups only: keep ours.
        state = dict(state)
        mode = state.pop("adam_w_mode", getattr(self, "adam_w_mode", AdamWMode.ADAMW_TRANSFORMERS))
        self.adam_w_mode = AdamWMode(mode)
        self.set_grad_none = state.pop("set_grad_none", getattr(self, "set_grad_none", True))
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("step", 0)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Drop (``set_grad_none``) or zero all gradients; zeroing is one multi-tensor launch per dtype."""
        if set_to_none is None:
            set_to_none = self.set_grad_none
        if set_to_none:
            super().zero_grad(set_to_none=True)
            return
        buckets: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                # Same detaching rule as torch.optim.Optimizer.zero_grad.
                if g.grad_fn is not None:
                    g.detach_()
                else:
                    g.requires_grad_(False)
                buckets.setdefault((g.device, g.dtype), []).append(g)
        for grads in buckets.values():
            torch._foreach_zero_(grads)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        params: list[Tensor] = []
        grads: list[Tensor] = []
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError(
                    "FusedAdam does not support sparse gradients; use torch.optim.SparseAdam for them"
                )
            params.append(p)
            grads.append(g)
        if not params:
            return
        group["step"] = group.get("step", 0) + 1

        exp_avgs: list[Tensor] = []
        exp_avg_sqs: list[Tensor] = []
        steps: list[int] = []
        for p in params:
            state = self.state[p]
            if not state:
                dtype = state_dtype_for(p.dtype)
                state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["step"] = state.get("step", 0) + 1
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])

        # Complex parameters are updated as pairs of reals, as torch's Adam updates them: the fused
        # kernels take real tensors only (they raised "not implemented for 'ComplexFloat'").
        params, grads, exp_avgs, exp_avg_sqs = (
            [torch.view_as_real(t) if t.is_complex() else t for t in tensors]
            for tensors in (params, grads, exp_avgs, exp_avg_sqs)
        )
        hypers: dict[int, _Hyper] = {}
        for step in dict.fromkeys(steps):
            hypers[step] = _Hyper(
                lr=float(group["lr"]),
                beta1=float(group["betas"][0]),
                beta2=float(group["betas"][1]),
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                step=step,
                bias_correction=bool(group["bias_correction"]),
                mode=self.adam_w_mode,
            )
        # Lists are split only where a single kernel cannot take them together (device, dtypes, and
        # the step count, which parameters updated since the group's first step all share).
        buckets: dict[tuple[torch.device, torch.dtype, torch.dtype, int], list[int]] = {}
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            if not p.stride() == g.stride() == exp_avgs[i].stride() == exp_avg_sqs[i].stride():
                # Multi-tensor kernels walk the four tensors' memory in the same order, so a gradient laid
                # out unlike its parameter (or a parameter with gaps) is updated on contiguous copies.
                _step_mismatched_layout(p, g, exp_avgs[i], exp_avg_sqs[i], hypers[steps[i]])
                continue
            buckets.setdefault((p.device, p.dtype, g.dtype, steps[i]), []).append(i)
        for (device, _, _, step), idx in buckets.items():
            hyper = hypers[step]
            ps = [params[i] for i in idx]
            gs = [grads[i] for i in idx]
            ms = [exp_avgs[i] for i in idx]
            vs = [exp_avg_sqs[i] for i in idx]
            if device.type == "cuda":
                # Imported here: importing triton costs ~1 s, and only CUDA parameters need it.
                from ortrain.optim import _multi_tensor_adam_triton as triton_adam

                if triton_adam.can_run(ps, gs, ms, vs):
                    triton_adam.multi_tensor_adam(ps, gs, ms, vs, hyper)
                    continue
            _torch_fused_adam(ps, gs, ms, vs, hyper)

    def _group_from(self, group: dict[str, Any], state: dict[Any, dict[str, Any]]) -> dict[str, Any]:
        """A saved parameter group as FusedAdam's: ``torch.optim.AdamW``'s (a Trainer resumed with
        another ``optim``) lacks ``bias_correction`` (a KeyError at the next step) and the group's
        step count (its parameters count theirs). One saved with ``amsgrad`` or ``maximize`` is
        refused: FusedAdam has neither, and would go on as another algorithm (or climb the loss)."""
        unsupported = [key for key in _UNSUPPORTED if group.get(key)]
        if unsupported:
            raise ValueError(
                f"this optimizer state was saved with {' and '.join(f'{k}=True' for k in unsupported)}, "
                "which FusedAdam does not implement; resume it with the optimizer that saved it "
                "(torch.optim.Adam / AdamW)"
            )
        group = {**self.defaults, **group}
        if "step" not in group:
            group["step"] = max(_steps_of(group, state), default=0)
        return group

    def state_dict(self) -> dict[str, Any]:
        """torch's form (each parameter's ``step`` a tensor), with the group's weight-decay
        convention as torch's Adam names it: ``torch.optim.AdamW`` (a resumed HF Trainer run
        switched from ``adamw_ort_fused`` to ``adamw_torch``) decayed as L2 regularization without it."""
        saved = super().state_dict()
        for group in saved["param_groups"]:
            # torch's Adam reads its convention from the group (AdamW is Adam with it True); a
            # group without it decays as L2 regularization. ADAMW_TRANSFORMERS has no torch twin.
            if self.adam_w_mode != AdamWMode.ADAMW_TRANSFORMERS:
                group["decoupled_weight_decay"] = self.adam_w_mode == AdamWMode.ADAMW_TORCH
        for pid, state in saved["state"].items():
            if "step" in state:
                saved["state"][pid] = {**state, "step": torch.tensor(float(state["step"]))}
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch.optim.Optimizer.load_state_dict casts floating state to the parameter's dtype, which
        # would round our fp32 moments of fp16/bf16 parameters to fp16: restore them at full precision.
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        saved_state = state_dict["state"]
        state_dict = {
            **state_dict,
            "param_groups": [self._group_from(g, saved_state) for g in state_dict["param_groups"]],
        }
        super().load_state_dict(state_dict)
        groups = [(g, p) for g in self.param_groups for p in g["params"]]
        for pid, (group, p) in zip(saved_ids, groups, strict=True):
            if pid not in saved_state:
                continue
            for key, value in saved_state[pid].items():
                if key == "step":
                    continue
                if isinstance(value, Tensor) and value.is_floating_point():
                    self.state[p][key] = value.to(device=p.device, dtype=state_dtype_for(p.dtype), copy=True)
            # A count of the parameter's own, or (a state saved before wave 31) its group's.
            self.state[p]["step"] = int(saved_state[pid].get("step", group["step"]))


def _steps_of(group: dict[str, Any], state: dict[Any, dict[str, Any]]) -> set[int]:
    return {int(state[pid]["step"]) for pid in group["params"] if "step" in state.get(pid, {})}


def _step_mismatched_layout(p: Tensor, g: Tensor, m: Tensor, v: Tensor, h: _Hyper) -> None:
    work_p, work_m, work_v = p.contiguous(), m.contiguous(), v.contiguous()
    _torch_fused_adam([work_p], [g.contiguous()], [work_m], [work_v], h)
    for dst, src in ((p, work_p), (m, work_m), (v, work_v)):
        if dst.data_ptr() != src.data_ptr():  # .contiguous() made a copy: write the result back
            dst.copy_(src)


class _Hyper:
    """Per-step scalars of one parameter group."""

    __slots__ = ("beta1", "beta2", "bias_correction", "eps", "lr", "mode", "step", "weight_decay")

    def __init__(
        self,
        *,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        step: int,
        bias_correction: bool,
        mode: AdamWMode,
    ) -> None:
        self.lr = lr
        self.beta1 = beta1
        self.beta2 = beta2
        self.eps = eps
        self.weight_decay = weight_decay
        self.step = step
        self.bias_correction = bias_correction
        self.mode = mode

    @property
    def bias_corrections(self) -> tuple[float, float]:
        if not self.bias_correction:
            return 1.0, 1.0
        return 1.0 - self.beta1**self.step, 1.0 - self.beta2**self.step


def _torch_fused_adam(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], h: _Hyper
) -> None:
    """One step through torch's fused Adam kernels, on any device they support.

    torch's kernels compute ``p -= (lr/bc1)·m/(√v/√bc2 + eps)`` with bc from the step tensor it is given,
    and decay either ``g += wd·p`` (Adam) or ``p *= 1 − lr·wd`` first (AdamW). The three modes map on it:

    * mode 0 is torch Adam, mode 2 torch AdamW, as is;
    * mode 1 multiplies ``(√v+eps)/√bc2`` out: eps' = eps/√bc2 gives ``lr·(√bc2/bc1)·m/(√v+eps)``; its decay
      after the update, ``p ← (p − u)(1 − lr·wd)``, equals torch AdamW's decay-then-update with
      lr' = lr(1 − lr·wd) and wd' = wd/(1 − lr·wd) (same decay factor, step scaled by it). One pass over
      memory instead of two.

    Without bias correction the step tensor is +inf: β^inf = 0 exactly, so torch's bc1 = bc2 = 1.
    """
    state_dtype = exp_avgs[0].dtype
    device = params[0].device
    step_value = float(h.step) if h.bias_correction else math.inf
    # One tensor shared by all entries: the raw kernels only read it (the torch.optim wrappers are the
    # ones that increment it), so no per-parameter step tensors are needed.
    step_tensor = torch.tensor(step_value, dtype=torch.float32, device=device)
    common: dict[str, Any] = {"beta1": h.beta1, "beta2": h.beta2, "amsgrad": False, "maximize": False}
    lr, wd, eps = h.lr, h.weight_decay, h.eps
    post_decay: float | None = None

    if h.mode == AdamWMode.ADAM_L2_REGULARIZATION:
        fused, kw = torch._fused_adam_, {"lr": lr, "weight_decay": wd, "eps": eps}
    elif h.mode == AdamWMode.ADAMW_TORCH:
        fused, kw = torch._fused_adamw_, {"lr": lr, "weight_decay": wd, "eps": eps}
    else:
        _, bc2 = h.bias_corrections
        eps_prime = eps / math.sqrt(bc2)
        decay = 1.0 - lr * wd
        if wd == 0.0:
            fused, kw = torch._fused_adam_, {"lr": lr, "weight_decay": 0.0, "eps": eps_prime}
        elif decay > 0.0:
            fused = torch._fused_adamw_
            kw = {"lr": lr * decay, "weight_decay": wd / decay, "eps": eps_prime}
        else:
            # lr·wd ≥ 1 (decay wipes or flips the weights): the rescaling above is undefined, so apply
            # the decay as a second multi-tensor pass.
            fused, kw = torch._fused_adam_, {"lr": lr, "weight_decay": 0.0, "eps": eps_prime}
            post_decay = decay

    def run(ps: list[Tensor], gs: list[Tensor], ms: list[Tensor], vs: list[Tensor]) -> None:
        fused(ps, gs, ms, vs, [], [step_tensor] * len(ps), **kw, **common)
        if post_decay is not None:
            torch._foreach_mul_(ps, post_decay)

    if params[0].dtype == state_dtype and grads[0].dtype == state_dtype:
        run(params, grads, exp_avgs, exp_avg_sqs)
    else:
        _run_upcast(run, params, grads, exp_avgs, exp_avg_sqs)


# fp32 scratch for the upcast parameters/gradients of fp16/bf16 buckets, reused across steps: fresh
# step-sized buffers cost more than the update itself on CPU (hundreds of MB of page faults per step), and
# slices this size stay in cache between the upcast, the update and the write-back.
_SCRATCH_ELEMENTS = 1 << 21
_scratch: dict[torch.device, Tensor] = {}


def _scratch_for(device: torch.device) -> Tensor:
    buf = _scratch.get(device)
    if buf is None:
        _scratch[device] = buf = torch.empty(2 * _SCRATCH_ELEMENTS, dtype=torch.float32, device=device)
    return buf


def _run_upcast(
    run: Callable[[list[Tensor], list[Tensor], list[Tensor], list[Tensor]], None],
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
) -> None:
    """fp32 math for fp16/bf16 tensors: upcast slices into scratch, update them, round parameters back.

    Tensors are cut into flat slices of at most ``_SCRATCH_ELEMENTS`` and packed into batches of that many
    elements; each batch is three multi-tensor launches (upcast, fused update, write-back).
    """
    dense = all(t.is_contiguous() for ts in (params, grads, exp_avgs, exp_avg_sqs) for t in ts)
    if not dense:  # slicing needs flat views; fall back to whole-tensor temporaries
        work_p = [p.float() if p.dtype != torch.float32 else p.clone() for p in params]
        work_g = [g.float() for g in grads]
        run(work_p, work_g, exp_avgs, exp_avg_sqs)
        torch._foreach_copy_(params, work_p)
        return
    scratch = _scratch_for(params[0].device)
    scratch_p, scratch_g = scratch[:_SCRATCH_ELEMENTS], scratch[_SCRATCH_ELEMENTS:]
    batch: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []
    used = 0

    def flush() -> None:
        nonlocal batch, used
        if not batch:
            return
        sizes = [piece[0].numel() for piece in batch]
        ps, gs, ms, vs = (list(x) for x in zip(*batch, strict=True))
        work_p = list(scratch_p[:used].split(sizes))
        work_g = list(scratch_g[:used].split(sizes))
        torch._foreach_copy_(work_p, ps)
        torch._foreach_copy_(work_g, gs)
        run(work_p, work_g, ms, vs)
        torch._foreach_copy_(ps, work_p)
        batch, used = [], 0

    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        flat = (p.view(-1), g.view(-1), m.view(-1), v.view(-1))
        n = flat[0].numel()
        for start in range(0, n, _SCRATCH_ELEMENTS):
            length = min(_SCRATCH_ELEMENTS, n - start)
            if used + length > _SCRATCH_ELEMENTS:
                flush()
            batch.append(tuple(t[start : start + length] for t in flat))  # type: ignore[arg-type]
            used += length
    flush()
