"""Mixed-precision training around any torch optimizer: fp32 master weights and dynamic loss scaling.

The model keeps its fp16/bf16 parameters (fast forward/backward); the wrapped optimizer sees fp32 master
copies of them instead, so small updates are not lost to fp16 rounding. Each step:

1. ``backward(loss)`` multiplies the loss by the loss scale, so small fp16 gradients do not flush to 0;
2. the model gradients are copied into fp32 master gradients and divided by the scale (multi-tensor ops);
3. one multi-tensor non-finite check (one host synchronisation) decides whether the step overflowed:
   if so the step is skipped and the scale backs off, otherwise the wrapped optimizer steps on the master
   weights and they are copied back into the model parameters.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ortrain.optim._multi_tensor_checks import bucket_by_device_and_dtype, nonfinite_flag

logger = logging.getLogger("ortrain.optim.mixed_precision")

__all__ = ["DynamicLossScaler", "MixedPrecisionOptimizer"]

LOW_PRECISION_DTYPES = (torch.float16, torch.bfloat16)


class DynamicLossScaler:
    """Loss scale that halves (``backoff_factor``) on overflow and grows after ``growth_interval`` good steps.

    With ``dynamic=False`` the scale stays at ``init_scale`` and overflowing steps are still skipped.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        dynamic: bool = True,
    ) -> None:
        if init_scale <= 0:
            raise ValueError(f"init_scale must be positive, got {init_scale}")
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.dynamic = dynamic
        self.good_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale = min(self.max_scale, self.scale * self.growth_factor)
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "dynamic": self.dynamic,
            "good_steps": self.good_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


class MixedPrecisionOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer built over fp16/bf16 parameters; see the module docstring.

    A ``torch.optim.Optimizer`` only so that learning-rate schedulers, which refuse anything else,
    attach to it (its ``param_groups`` are the wrapped optimizer's); it keeps no state of its own
    there, and its hooks are the wrapped optimizer's. Gradients from a ``loss.backward()`` of the
    caller's own (not :meth:`backward`) are taken as unscaled, with one warning.

    Typical loop::

        optimizer = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters()))
        optimizer.zero_grad()
        optimizer.backward(loss)
        optimizer.clip_master_grads(1.0)  # optional
        optimizer.step()                  # skipped (returns None) if the gradients overflowed

    The wrapped optimizer's ``param_groups`` now hold the fp32 masters (fp32 model parameters are their own
    masters). Weights changed in the model between steps (``model.load_state_dict``, a restored
    snapshot) are read back into their masters at the next step.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        dynamic_loss_scale: bool = True,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
    ) -> None:
        self.optimizer = optimizer
        self.loss_scaler = DynamicLossScaler(
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            min_scale=min_scale,
            max_scale=max_scale,
            dynamic=dynamic_loss_scale,
        )
        # Low-precision model parameters and their fp32 masters, in the same order.
        self.model_params: list[Tensor] = []
        self.master_params: list[Tensor] = []
        # fp32 model parameters, updated in place by the wrapped optimizer.
        self.fp32_params: list[Tensor] = []
        # What each model parameter was when this wrapper last wrote or read it: its storage and
        # version counter (``load_state_dict`` and in-place writes bump the version).
        self._model_stamps: list[tuple[int, int]] = []
        for group in optimizer.param_groups:
            self._take_over(group)
        self._unscaled = False
        self._overflow = False
        self.last_step_skipped = False
        # Whether the gradients were made by ``self.backward`` (scaled) since the last step: a loop
        # that calls ``loss.backward()`` itself (the Hugging Face Trainer, accelerate) hands over
        # unscaled gradients, which were divided by the scale (65536) until wave 45's second look.
        self._scaled_backward = False

    def _take_over(self, group: dict[str, Any]) -> None:
        """Give ``group``'s low-precision parameters fp32 masters in the wrapped optimizer."""
        for i, p in enumerate(group["params"]):
            if p.dtype not in LOW_PRECISION_DTYPES:
                self.fp32_params.append(p)
                continue
            master = p.detach().clone().float().requires_grad_(p.requires_grad)
            group["params"][i] = master
            # State created before wrapping moves to the master, in fp32.
            if p in self.optimizer.state:
                self.optimizer.state[master] = {
                    k: v.float() if isinstance(v, Tensor) and v.is_floating_point() else v
                    for k, v in self.optimizer.state.pop(p).items()
                }
            self.model_params.append(p)
            self.master_params.append(master)
            self._model_stamps.append(_stamp(p))

    def __getstate__(self) -> dict[str, Any]:  # torch.optim.Optimizer's keeps only its own fields
        # Not a scheduler's patch of ``step`` (bound to this object: a copy stepped the original).
        return {k: v for k, v in self.__dict__.items() if k not in ("step", "_opt_called")}

    # The wrapped optimizer runs the hooks (it steps the masters): registered there.
    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> Any:
        return self.optimizer.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook: Callable[..., Any], prepend: bool = False) -> Any:
        return self.optimizer.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook: Callable[..., Any], prepend: bool = False) -> Any:
        return self.optimizer.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook: Callable[..., Any], prepend: bool = False) -> Any:
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook: Callable[..., Any], prepend: bool = False) -> Any:
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @torch.no_grad()
    def _reread_changed_weights(self) -> None:
        """Masters of model weights changed outside this wrapper since it last wrote them: read back
        from the model. Until wave 45 the next step copied the stale masters over them, silently
        undoing a ``model.load_state_dict`` made after the wrapper was built (the weights went back
        to their random init) or a rollback to a snapshot."""
        changed = 0
        for i, (model_p, master) in enumerate(zip(self.model_params, self.master_params, strict=True)):
            stamp = _stamp(model_p)
            if stamp == self._model_stamps[i]:
                continue
            self._model_stamps[i] = stamp
            # The master's own rounding written back (a checkpoint's model weights loaded after
            # the optimizer's masters): the master holds those values with their low bits.
            if not torch.equal(model_p, master.to(model_p.dtype)):
                master.copy_(model_p)
                changed += 1
        if changed:
            logger.info(
                "%d model weight(s) changed outside the optimizer since its last step "
                "(load_state_dict, a restored snapshot): their fp32 masters are read from the model",
                changed,
            )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (unfrozen layers, a new head) to the wrapped optimizer, with fp32 masters."""
        self.optimizer.add_param_group(param_group)
        self._take_over(self.optimizer.param_groups[-1])

    def _check_groups(self) -> None:
        """Refuse a low-precision parameter added to the wrapped optimizer behind the wrapper's back:
        it would be stepped on the scaled gradients, without a master or an overflow check (wave 41:
        a bf16 weight moved by 11.5 where 0.011 was due)."""
        ours = {id(p) for p in self.master_params + self.fp32_params}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) in ours:
                    continue
                if p.dtype in LOW_PRECISION_DTYPES:
                    raise RuntimeError(
                        f"a {p.dtype} parameter of shape {tuple(p.shape)} was added to the wrapped optimizer "
                        "directly (wrapper.optimizer.add_param_group): add it with wrapper.add_param_group, "
                        "which gives it an fp32 master and unscales its gradient"
                    )
                self.fp32_params.append(p)  # an fp32 parameter is its own master
                ours.add(id(p))

    # ---- torch.optim.Optimizer surface ------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.master_params:
            p.grad = None  # master gradients are rebuilt from the model gradients every step
        for p in self.model_params + self.fp32_params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()
        self._unscaled = False
        self._scaled_backward = False

    def backward(self, loss: Tensor, **kwargs: Any) -> None:
        """``(loss · scale).backward()``; the scaling is undone on the fp32 master gradients."""
        self._unscaled = False
        self._scaled_backward = True
        (loss.float() * self.loss_scaler.scale).backward(**kwargs)

    def _unscale(self) -> None:
        """Model gradients → unscaled fp32 master gradients, and the overflow verdict (one sync)."""
        if self._unscaled:
            return
        if not self._scaled_backward:
            _warn_once_unscaled_backward()
        inv_scale = 1.0 / self.loss_scaler.scale if self._scaled_backward else 1.0
        copies: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {}
        master_grads: list[Tensor] = []
        self._check_groups()
        for master, p in zip(self.master_params, self.model_params, strict=True):
            if p.grad is None:
                # No gradient this step (a frozen or unused layer; the model's grads cleared by
                # ``model.zero_grad()``, not the wrapper's): the optimizer must not step it on the
                # previous step's master gradient (until wave 41 it did).
                master.grad = None
                continue
            master.grad = torch.empty_like(master)
            master_grads.append(master.grad)
            dst, src = copies.setdefault((p.grad.device, p.grad.dtype), ([], []))
            dst.append(master.grad)
            src.append(p.grad)
        for dst, src in copies.values():
            torch._foreach_copy_(dst, src)  # upcast to fp32
        fp32_grads = [p.grad for p in self.fp32_params if p.grad is not None]
        for grads in bucket_by_device_and_dtype(master_grads + fp32_grads).values():
            torch._foreach_mul_(grads, inv_scale)
        self._overflow = bool(nonfinite_flag(master_grads + fp32_grads))
        self._unscaled = True

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the unscaled fp32 gradients to ``max_norm``; returns their total norm (inf on overflow)."""
        self._unscale()
        if self._overflow:
            return float("inf")
        params = [p for p in self.master_params + self.fp32_params if p.grad is not None]
        if not params:
            return 0.0
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type, foreach=True))

    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        """Steps the wrapped optimizer on the masters unless the gradients overflowed.

        A closure must compute the loss and call ``self.backward(loss)`` itself.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._reread_changed_weights()
        self._unscale()
        overflow = self._overflow
        self._unscaled = False
        self._scaled_backward = False
        self.last_step_skipped = overflow
        scale = self.loss_scaler.scale
        self.loss_scaler.update(overflow)
        if overflow:
            logger.info(
                "gradient overflow at loss scale %g: step skipped, scale now %g", scale, self.loss_scale
            )
            for p in self.master_params:
                p.grad = None
            return None
        self.optimizer.step()
        self._copy_masters_to_model()
        return loss

    @torch.no_grad()
    def _copy_masters_to_model(self) -> None:
        buckets: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {}
        for model_p, master in zip(self.model_params, self.master_params, strict=True):
            dst, src = buckets.setdefault((model_p.device, model_p.dtype), ([], []))
            dst.append(model_p)
            src.append(master)
        for dst, src in buckets.values():
            torch._foreach_copy_(dst, src)
        self._model_stamps = [_stamp(p) for p in self.model_params]

    # ---- checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # The masters are saved too: the fp16 model weights alone lose the low bits of each weight.
        self._reread_changed_weights()
        return {
            "optimizer": self.optimizer.state_dict(),
            "loss_scaler": self.loss_scaler.state_dict(),
            "master_params": [m.detach().clone() for m in self.master_params],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        saved = state_dict["master_params"]
        if len(saved) != len(self.master_params):
            raise ValueError(
                f"state_dict has {len(saved)} master parameters, this optimizer has {len(self.master_params)}"
            )
        with torch.no_grad():
            for master, value in zip(self.master_params, saved, strict=True):
                master.copy_(value)
        self._copy_masters_to_model()


@functools.cache
def _warn_once_unscaled_backward() -> None:
    logger.warning(
        "FP16_Optimizer: step() after a backward that was not optimizer.backward(loss) (the Hugging "
        "Face Trainer, accelerate, or loss.backward()): the gradients are taken as unscaled, and this "
        "step has no loss scaling; call optimizer.backward(loss) for it"
    )


def _stamp(p: Tensor) -> tuple[int, int]:
    """Where ``p``'s values live and how often they were written in place. A write through
    ``p.data`` (a fresh version counter) is not seen: use ``p.copy_`` under ``torch.no_grad()``."""
    return p.data_ptr(), p._version
