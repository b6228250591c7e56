"""FP16_Optimizer on plain torch optimizers: the fp32-master, dynamic-loss-scale wrapper."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from ortrain.optim import FusedAdam
from ortrain.optim._multi_tensor_checks import multi_tensor_norm, nonfinite_flag
from ortrain.optim.fp16_optimizer import FP16_Optimizer
from ortrain.optim.mixed_precision import DynamicLossScaler, MixedPrecisionOptimizer


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return model.to(dtype)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=gen)
    y = torch.sin(x[:, :4].sum(1, keepdim=True))
    return x, y


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    return torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)


@pytest.mark.parametrize("inner", ["adamw", "fused_adam"])
def test_fp16_model_reaches_fp32_twin_loss(inner: str) -> None:
    """Same init, data and schedule; after 150 steps the fp16 model's loss is within 5% of the fp32 one's."""
    x, y = _data()
    losses = {}
    for dtype in (torch.float32, torch.float16):
        model = _model(dtype)
        if inner == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        else:
            opt = FusedAdam(model.parameters(), lr=1e-2)
        if dtype == torch.float16:
            opt = FP16_Optimizer(opt, init_scale=2.0**12, growth_interval=50)
            assert isinstance(opt, MixedPrecisionOptimizer)
        for _ in range(150):
            opt.zero_grad()
            loss = _loss(model, x, y)
            if dtype == torch.float16:
                opt.backward(loss)
            else:
                loss.backward()
            opt.step()
        with torch.no_grad():
            losses[dtype] = _loss(model, x, y).item()
    initial = _loss(_model(torch.float32), x, y).item()
    assert losses[torch.float32] < 0.2 * initial  # the task is actually learned
    assert abs(losses[torch.float16] - losses[torch.float32]) <= 0.05 * losses[torch.float32]


def test_overflow_step_is_skipped_and_scale_backs_off(caplog: pytest.LogCaptureFixture) -> None:
    x, y = _data()
    model = _model(torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), init_scale=2.0**10, growth_interval=2)
    before = [p.detach().clone() for p in model.parameters()]
    masters_before = [m.detach().clone() for m in opt.master_params]

    opt.zero_grad()
    opt.backward(_loss(model, x, y))
    next(model.parameters()).grad[0, 0] = float("inf")  # an fp16 gradient overflowed
    with caplog.at_level(logging.INFO, logger="ortrain.optim.mixed_precision"):
        assert opt.step() is None
    assert opt.last_step_skipped
    assert opt.loss_scale == 2.0**9
    assert "step skipped" in caplog.text
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)
    for m, b in zip(opt.master_params, masters_before, strict=True):
        assert torch.equal(m.detach(), b)

    # Two good steps grow the scale back (growth_interval=2) and do update the weights.
    for _ in range(2):
        opt.zero_grad()
        opt.backward(_loss(model, x, y))
        opt.step()
        assert not opt.last_step_skipped
    assert opt.loss_scale == 2.0**10
    assert not torch.equal(next(model.parameters()).detach(), before[0])


def test_huge_loss_scale_overflows_in_fp16_backward() -> None:
    """A real fp16 overflow: scaled gradients exceed fp16's 65504 and turn to inf."""
    x, y = _data()
    model = _model(torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), init_scale=2.0**24)
    opt.zero_grad()
    opt.backward(_loss(model, x, y) * 1e3)
    assert opt.step() is None
    assert opt.loss_scale == 2.0**23


def test_master_grads_are_unscaled_and_clipped() -> None:
    x, y = _data()
    model = _model(torch.float16)
    twin = _model(torch.float32)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), init_scale=2.0**8)
    opt.zero_grad()
    opt.backward(_loss(model, x, y))
    _loss(twin, x, y).backward()
    norm = opt.clip_master_grads(0.05)
    ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in twin.parameters()])).item()
    assert norm == pytest.approx(ref_norm, rel=2e-2)  # fp16 forward/backward vs fp32
    clipped = torch.linalg.vector_norm(torch.stack([m.grad.norm() for m in opt.master_params])).item()
    assert clipped == pytest.approx(min(0.05, ref_norm), rel=1e-4)
    assert all(m.grad.dtype == torch.float32 for m in opt.master_params)


def test_state_dict_resume_is_bit_exact() -> None:
    x, y = _data()

    def train(model: torch.nn.Module, opt: MixedPrecisionOptimizer, steps: int) -> None:
        for _ in range(steps):
            opt.zero_grad()
            opt.backward(_loss(model, x, y))
            opt.step()

    model = _model(torch.float16)
    opt = FP16_Optimizer(torch.optim.Adam(model.parameters(), lr=1e-2), growth_interval=3)
    train(model, opt, 4)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    train(model, opt, 4)

    model2 = _model(torch.float16)
    model2.load_state_dict(saved_model)
    opt2 = FP16_Optimizer(torch.optim.Adam(model2.parameters(), lr=1e-2), growth_interval=3)
    opt2.load_state_dict(saved_opt)
    train(model2, opt2, 4)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    assert opt.loss_scale == opt2.loss_scale


def test_an_fp32_only_optimizer_is_wrapped_for_its_loss_scaling(caplog: pytest.LogCaptureFixture) -> None:
    """Until wave 45 it came back unchanged, and the documented loop failed at
    ``optimizer.backward(loss)`` (no such method on a torch optimizer); a float32 model under
    float16 autocast needs the loss scaling all the same."""
    torch.manual_seed(0)
    model = _model(torch.float32)
    reference = copy.deepcopy(model)
    with caplog.at_level(logging.INFO, logger="ortrain.optim.fp16_optimizer"):
        opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert "no fp16/bf16 parameters" in caplog.text
    assert FP16_Optimizer(opt) is opt  # wrapping twice: the same wrapper
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    x = torch.randn(4, 16)
    opt.zero_grad()
    opt.backward(model(x).pow(2).mean())
    opt.step()
    reference(x).pow(2).mean().backward()
    plain.step()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_weights_loaded_after_the_wrapper_is_built_are_the_ones_stepped() -> None:
    """The masters were copied once, at wrapping: a ``model.load_state_dict`` after it was undone by
    the next step, which wrote the stale masters over the loaded weights (wave 45's review: the
    weights went back to their random init, 0.4 away)."""
    torch.manual_seed(0)
    model = _model(torch.float16)
    pretrained = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    model.load_state_dict(pretrained)
    opt.zero_grad()
    opt.backward(model(torch.randn(4, 16, dtype=torch.float16)).float().pow(2).mean())
    opt.step()
    for name, value in model.state_dict().items():
        assert (value.float() - pretrained[name].float()).abs().max() < 0.05, name
    snapshot = copy.deepcopy(model.state_dict())
    opt.zero_grad()
    opt.backward(model(torch.randn(4, 16, dtype=torch.float16)).float().pow(2).mean())
    opt.step()
    model.load_state_dict(snapshot)  # a rollback: the optimizer state goes on from the snapshot
    masters = opt.state_dict()["master_params"]  # read back from the restored weights
    for (name, value), master in zip(snapshot.items(), masters, strict=True):
        assert torch.equal(master, value.float()), name


def test_model_weights_loaded_after_the_optimizer_keep_the_masters_low_bits() -> None:
    """A checkpoint loaded optimizer first, then model: the model's weights are the masters'
    rounding, and the masters keep their float32 bits (not re-read from the float16 weights)."""
    model = _model(torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    for _ in range(2):
        opt.zero_grad()
        opt.backward(model(torch.randn(4, 16, dtype=torch.float16)).float().pow(2).mean())
        opt.step()
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    resumed = _model(torch.float16)
    resumed_opt = FP16_Optimizer(torch.optim.SGD(resumed.parameters(), lr=1e-3))
    resumed_opt.load_state_dict(saved_opt)
    resumed.load_state_dict(saved_model)
    kept = resumed_opt.state_dict()["master_params"]
    for master, saved in zip(kept, saved_opt["master_params"], strict=True):
        assert torch.equal(master, saved)


def test_a_scheduler_attaches_to_the_wrapper_and_it_pickles() -> None:
    """Schedulers refuse anything but a ``torch.optim.Optimizer`` ("MixedPrecisionOptimizer is not
    an Optimizer", wave 45's review); the wrapper is one, and its own fields survive a copy."""
    model = _model(torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        opt.zero_grad()
        opt.backward(model(torch.randn(4, 16, dtype=torch.float16)).float().pow(2).mean())
        opt.step()
        scheduler.step()
    assert opt.optimizer.param_groups[0]["lr"] == 0.25
    copied = copy.deepcopy(opt)
    assert copied.loss_scale == opt.loss_scale
    assert len(copied.master_params) == len(opt.master_params)


def test_loss_scaler_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScaler(backoff_factor=1.5)
    with pytest.raises(ValueError, match="growth_factor"):
        DynamicLossScaler(growth_factor=1.0)


def test_multi_tensor_checks_match_per_tensor_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(n, generator=gen).to(dt)
        for n, dt in [(5, torch.float32), (0, torch.float16), (33, torch.float16), (7, torch.bfloat16)]
    ]
    assert not bool(nonfinite_flag(tensors))
    ref = torch.linalg.vector_norm(torch.cat([t.float() for t in tensors]))
    torch.testing.assert_close(multi_tensor_norm(tensors), ref)
    ref_inf = torch.cat([t.float() for t in tensors]).abs().max()
    torch.testing.assert_close(multi_tensor_norm(tensors, float("inf")), ref_inf)
    for bad in (float("inf"), float("-inf"), float("nan")):
        broken = [t.clone() for t in tensors]
        broken[2][3] = bad
        assert bool(nonfinite_flag([*broken, None]))
    assert not bool(nonfinite_flag([]))


def test_a_parameter_without_a_gradient_is_not_stepped_on_an_old_one() -> None:
    """The model's gradients cleared with ``model.zero_grad()`` (not the wrapper's) and a layer that
    gets none this step: until wave 41 its master kept the previous step's gradient and SGD moved
    the weight again (by 0.111 where eager moves it by 0)."""
    model = _model(torch.bfloat16)
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), init_scale=8.0)
    x, y = _data()
    optimizer.backward(_loss(model, x, y))
    optimizer.step()
    model.zero_grad(set_to_none=True)
    head = model[2].weight
    before = head.detach().clone()
    optimizer.backward(_loss(model, x, y))
    head.grad = None  # this step's loss does not reach the head (a frozen or skipped layer)
    optimizer.step()
    torch.testing.assert_close(head.detach(), before, rtol=0, atol=0)


def test_groups_added_later_get_masters_and_a_direct_one_is_refused() -> None:
    """A group added through the wrapper (layers unfrozen late) trains through fp32 masters like
    the first ones; one added to the wrapped optimizer directly, where schedulers attach, was
    stepped on the scaled gradient without a master (until wave 41: a weight moved by 11.5 where
    0.011 was due) and is now refused with what to call instead."""
    torch.manual_seed(0)
    body, head = torch.nn.Linear(4, 4).to(torch.bfloat16), torch.nn.Linear(4, 1).to(torch.bfloat16)
    reference = copy.deepcopy(head).float()
    optimizer = FP16_Optimizer(torch.optim.SGD(body.parameters(), lr=0.01), init_scale=1024.0)
    optimizer.add_param_group({"params": list(head.parameters()), "lr": 0.01})
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.01)
    x = torch.randn(8, 4)
    features = body(x.to(torch.bfloat16)).detach()
    optimizer.backward(head(features).float().square().mean())
    reference(features.float()).square().mean().backward()
    optimizer.step()
    reference_optimizer.step()
    torch.testing.assert_close(head.weight.float(), reference.weight, rtol=2e-2, atol=2e-3)

    late = torch.nn.Parameter(torch.zeros(1, 4, dtype=torch.bfloat16))
    optimizer.optimizer.add_param_group({"params": [late]})
    late.grad = torch.ones_like(late)
    with pytest.raises(RuntimeError, match=r"add it with wrapper\.add_param_group"):
        optimizer.step()


def test_a_loop_calling_loss_backward_itself_steps_on_unscaled_gradients(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The Hugging Face Trainer and accelerate call ``loss.backward()``, not the wrapper's: the
    gradients were divided by the loss scale all the same (65536), and the model barely trained
    (wave 45's second look, once an fp32 optimizer came back wrapped)."""
    from ortrain.optim import mixed_precision

    mixed_precision._warn_once_unscaled_backward.cache_clear()  # an earlier test may have warned
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        model = _model(dtype)
        reference = copy.deepcopy(model).float()
        opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        plain = torch.optim.SGD(reference.parameters(), lr=0.1)
        x = torch.randn(4, 16)
        with caplog.at_level(logging.WARNING, logger="ortrain.optim"):
            opt.zero_grad()
            model(x.to(dtype)).float().pow(2).mean().backward()
            opt.step()
        plain.zero_grad()
        reference(x.to(dtype).float()).pow(2).mean().backward()
        plain.step()
        for a, b in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(a.float(), b, atol=2e-3, rtol=2e-3)
    assert "the gradients are taken as unscaled" in caplog.text


def test_the_wrapper_copies_apart_from_its_scheduler_and_takes_hooks() -> None:
    """A scheduler patches ``step`` on the wrapper: a deep copy stepped the original, and pickling
    failed; the Optimizer hook API raised AttributeError (wave 45's second look)."""
    import pickle

    model = _model(torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    copied = copy.deepcopy(opt)
    assert all(a is not b for a, b in zip(copied.master_params, opt.master_params, strict=True))
    before = [m.clone() for m in opt.master_params]
    for m in copied.master_params:
        m.grad = torch.ones_like(m)
    copied.optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, opt.master_params, strict=True))
    assert pickle.loads(pickle.dumps(opt)).loss_scale == opt.loss_scale
    calls: list[str] = []
    opt.register_step_pre_hook(lambda optimizer, args, kwargs: calls.append("pre"))
    opt.zero_grad()
    opt.backward(model(torch.randn(4, 16, dtype=torch.float16)).float().pow(2).mean())
    opt.step()
    assert calls == ["pre"]
