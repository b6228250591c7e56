"""FusedAdam against independent references: torch.optim.Adam/AdamW and the issue's formulas."""

from __future__ import annotations

import copy

import pytest
import torch
from optim_reference import adam_formula_step

from ortrain.optim import AdamWMode, FusedAdam

SHAPES = [(7,), (13, 5), (3, 4, 5), (1,), (2049,)]
STEPS = 20
HYPER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": 0.1}


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _set_grads(params: list[torch.Tensor], step: int) -> None:
    for p, g in zip(params, _grads(step), strict=True):
        p.grad = g.to(p.dtype)


def _torch_reference(mode: AdamWMode, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    kwargs = {"lr": HYPER["lr"], "betas": HYPER["betas"], "eps": HYPER["eps"], "foreach": False}
    if mode == AdamWMode.ADAM_L2_REGULARIZATION:
        return torch.optim.Adam(params, weight_decay=HYPER["weight_decay"], **kwargs)
    return torch.optim.AdamW(params, weight_decay=HYPER["weight_decay"], **kwargs)


@pytest.mark.parametrize("mode", list(AdamWMode))
def test_fp32_matches_reference_over_20_steps(mode: AdamWMode) -> None:
    """Modes 0/2 against torch.optim.Adam/AdamW (single-tensor), mode 1 against the fp64 formula."""
    params = _params(torch.float32)
    opt = FusedAdam(params, adam_w_mode=mode, **HYPER)
    if mode == AdamWMode.ADAMW_TRANSFORMERS:
        ref = [p.detach().double() for p in params]
        ms = [torch.zeros_like(p) for p in ref]
        vs = [torch.zeros_like(p) for p in ref]
    else:
        ref_params = [p.detach().clone().requires_grad_() for p in params]
        ref_opt = _torch_reference(mode, ref_params)
    for step in range(1, STEPS + 1):
        _set_grads(params, step)
        opt.step()
        if mode == AdamWMode.ADAMW_TRANSFORMERS:
            for i, g in enumerate(_grads(step)):
                ref[i], ms[i], vs[i] = adam_formula_step(
                    ref[i], g, ms[i], vs[i], step, mode=int(mode), **HYPER
                )
        else:
            _set_grads(ref_params, step)
            ref_opt.step()
            ref = [p.detach() for p in ref_params]
    # 1e-6 absolute, relative above |p| = 1: there an fp32 ulp is >= 1.2e-7 and 20 steps of any fp32
    # evaluation order (the formula's own included) drift a few ulp from the exact fp64 result.
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.detach().double(), r.double(), atol=1e-6, rtol=1e-6)
    assert opt.param_groups[0]["step"] == STEPS


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", list(AdamWMode))
def test_low_precision_params_use_fp32_math(mode: AdamWMode, dtype: torch.dtype) -> None:
    """fp16/bf16 params: fp32 moments, fp32 math, parameter rounded to its dtype after every step.

    The reference does the same with torch.optim (modes 0, 2) or the formula (mode 1) in fp32/fp64 on an
    fp32 copy that is rounded through ``dtype`` after each step. The moments must agree within 1e-6; the
    parameters must agree exactly except where the two fp32 results straddle a ``dtype`` rounding boundary,
    which may move an element by one ulp of ``dtype``.
    """
    params = _params(dtype)
    opt = FusedAdam(params, adam_w_mode=mode, **HYPER)
    ref = [p.detach().float().clone().requires_grad_() for p in params]
    ref_opt = _torch_reference(mode, ref) if mode != AdamWMode.ADAMW_TRANSFORMERS else None
    ms = [torch.zeros_like(p, dtype=torch.float64) for p in ref]
    vs = [torch.zeros_like(p, dtype=torch.float64) for p in ref]
    for step in range(1, STEPS + 1):
        _set_grads(params, step)
        opt.step()
        grads = [g.to(dtype).float() for g in _grads(step)]  # what FusedAdam sees, upcast
        if ref_opt is not None:
            for r, g in zip(ref, grads, strict=True):
                r.grad = g
            ref_opt.step()
        else:
            for i, g in enumerate(grads):
                new_p, ms[i], vs[i] = adam_formula_step(ref[i], g, ms[i], vs[i], step, mode=1, **HYPER)
                ref[i].data.copy_(new_p)
        with torch.no_grad():
            for r in ref:
                r.copy_(r.to(dtype).float())
    for i, (p, r) in enumerate(zip(params, ref, strict=True)):
        state = opt.state[p]
        assert state["exp_avg"].dtype == torch.float32
        ref_m = ref_opt.state[r]["exp_avg"] if ref_opt is not None else ms[i]
        ref_v = ref_opt.state[r]["exp_avg_sq"] if ref_opt is not None else vs[i]
        torch.testing.assert_close(state["exp_avg"].double(), ref_m.double(), atol=1e-6, rtol=0)
        torch.testing.assert_close(state["exp_avg_sq"].double(), ref_v.double(), atol=1e-6, rtol=0)
        assert p.dtype == dtype
        ulp = torch.finfo(dtype).eps * r.detach().abs().clamp_min(torch.finfo(dtype).tiny)
        diff = (p.detach().float() - r.detach()).abs()
        assert bool((diff <= ulp).all()), f"param {i}: max diff {diff.max().item()}"
        assert (diff > 0).float().mean().item() < 0.01


@pytest.mark.parametrize("mode", list(AdamWMode))
def test_without_bias_correction(mode: AdamWMode) -> None:
    params = _params(torch.float32)
    opt = FusedAdam(params, adam_w_mode=mode, bias_correction=False, **HYPER)
    ref = [p.detach().double() for p in params]
    ms = [torch.zeros_like(p) for p in ref]
    vs = [torch.zeros_like(p) for p in ref]
    for step in range(1, 6):
        _set_grads(params, step)
        opt.step()
        for i, g in enumerate(_grads(step)):
            ref[i], ms[i], vs[i] = adam_formula_step(
                ref[i], g, ms[i], vs[i], step, mode=int(mode), bias_correction=False, **HYPER
            )
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.detach().double(), r, atol=1e-6, rtol=0)


def test_transformers_mode_with_decay_factor_at_or_below_zero() -> None:
    """lr·wd ≥ 1 takes the two-pass path (the one-pass rescaling divides by 1 − lr·wd)."""
    hyper = {**HYPER, "lr": 0.5, "weight_decay": 3.0}
    params = _params(torch.float32)
    opt = FusedAdam(params, adam_w_mode=AdamWMode.ADAMW_TRANSFORMERS, **hyper)
    ref = [p.detach().double() for p in params]
    ms = [torch.zeros_like(p) for p in ref]
    vs = [torch.zeros_like(p) for p in ref]
    for step in range(1, 4):
        _set_grads(params, step)
        opt.step()
        for i, g in enumerate(_grads(step)):
            ref[i], ms[i], vs[i] = adam_formula_step(ref[i], g, ms[i], vs[i], step, mode=1, **hyper)
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.detach().double(), r, atol=1e-6, rtol=1e-6)


def test_params_without_grad_are_skipped_and_groups_count_their_own_steps() -> None:
    params = _params(torch.float32)
    frozen = torch.randn(4, requires_grad=True)
    before = frozen.detach().clone()
    opt = FusedAdam([{"params": params}, {"params": [frozen], "lr": 0.1}], **HYPER)
    for step in range(1, 4):
        _set_grads(params, step)
        opt.step()
    assert torch.equal(frozen.detach(), before)
    assert frozen not in opt.state or not opt.state[frozen]
    assert opt.param_groups[0]["step"] == 3
    assert opt.param_groups[1]["step"] == 0
    frozen.grad = torch.ones(4)
    opt.step()
    assert opt.param_groups[1]["step"] == 1
    assert not torch.equal(frozen.detach(), before)


def test_sparse_gradient_raises() -> None:
    emb = torch.nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    opt = FusedAdam(emb.parameters())
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()


def test_invalid_hyperparameters_raise() -> None:
    p = [torch.zeros(1, requires_grad=True)]
    with pytest.raises(ValueError, match="learning rate"):
        FusedAdam(p, lr=-1.0)
    with pytest.raises(ValueError, match="beta"):
        FusedAdam(p, betas=(1.0, 0.999))
    with pytest.raises(ValueError, match="AdamWMode"):
        FusedAdam(p, adam_w_mode=7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_resume_is_bit_exact(dtype: torch.dtype) -> None:
    params = _params(dtype)
    opt = FusedAdam(params, **HYPER)
    for step in range(1, 6):
        _set_grads(params, step)
        opt.step()
    saved_opt = copy.deepcopy(opt.state_dict())
    saved_params = [p.detach().clone() for p in params]
    for step in range(6, 11):
        _set_grads(params, step)
        opt.step()

    resumed = [p.clone().requires_grad_() for p in saved_params]
    opt2 = FusedAdam(resumed, **HYPER)
    opt2.load_state_dict(saved_opt)
    assert opt2.state[resumed[0]]["exp_avg"].dtype == torch.float32  # not rounded to the param dtype
    for step in range(6, 11):
        _set_grads(resumed, step)
        opt2.step()
    for a, b in zip(params, resumed, strict=True):
        assert torch.equal(a.detach(), b.detach())
    assert opt2.param_groups[0]["step"] == 10


def test_zero_grad_set_to_none_and_zeroing() -> None:
    params = _params(torch.float32)
    _set_grads(params, 1)
    FusedAdam(params, set_grad_none=False).zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in params)
    FusedAdam(params).zero_grad()
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("scratch", [100, 3000])
def test_low_precision_slicing_does_not_change_results(monkeypatch: pytest.MonkeyPatch, scratch: int) -> None:
    """fp16/bf16 buckets are upcast in scratch-sized slices; slice boundaries must not change the math."""
    import ortrain.optim.fused_adam as fused_adam_module

    def run(params: list[torch.Tensor]) -> None:
        opt = FusedAdam(params, **HYPER)
        for step in range(1, 4):
            _set_grads(params, step)
            opt.step()

    whole = _params(torch.bfloat16)
    run(whole)
    monkeypatch.setattr(fused_adam_module, "_SCRATCH_ELEMENTS", scratch)
    monkeypatch.setattr(fused_adam_module, "_scratch", {})
    sliced = _params(torch.bfloat16)
    run(sliced)
    for a, b in zip(whole, sliced, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gradient_laid_out_unlike_its_param(dtype: torch.dtype) -> None:
    """A transposed parameter with a contiguous gradient (torch's own fused AdamW gets this wrong on CPU)."""
    base = torch.randn(7, 5).to(dtype)
    contiguous = base.t().contiguous().requires_grad_()
    strided = base.clone().t().requires_grad_()  # same values, transposed strides
    assert not strided.is_contiguous()
    grad = torch.randn(5, 7).to(dtype)
    for p in (contiguous, strided):
        p.grad = grad.clone()
        FusedAdam([p], **HYPER).step()
    assert torch.equal(contiguous, strided)


def _adamw_steps(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], steps: int, seed: int) -> None:
    torch.manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()


@pytest.mark.parametrize("first", ["torch", "fused"])
def test_state_moves_between_fused_adam_and_torch_adamw(first: str) -> None:
    """A Trainer resumed with the other ``optim``: torch AdamW's state lacked FusedAdam's group keys
    (KeyError 'bias_correction' at the next step) and FusedAdam's lacked AdamW's per-parameter
    ``step`` (KeyError 'step' on load). Both now continue as one optimizer would have."""
    torch.manual_seed(0)
    start = [torch.randn(5, 3), torch.randn(3)]
    make = {
        "torch": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, eps=1e-8),
        "fused": lambda ps: FusedAdam(
            ps, lr=1e-2, weight_decay=0.1, eps=1e-8, adam_w_mode=AdamWMode.ADAMW_TORCH
        ),
    }
    second = "fused" if first == "torch" else "torch"
    reference = [p.clone() for p in start]
    optimizer = make[first](reference)
    _adamw_steps(optimizer, reference, 3, seed=1)
    moved = [p.clone() for p in reference]
    resumed = make[second](moved)
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # as if read back from a file
    _adamw_steps(optimizer, reference, 2, seed=2)
    _adamw_steps(resumed, moved, 2, seed=2)
    for a, b in zip(moved, reference, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("option", ["amsgrad", "maximize"])
def test_a_torch_state_saved_with_an_option_fused_adam_lacks_is_refused(option: str) -> None:
    """Wave 37: the group's ``amsgrad=True`` or ``maximize=True`` loaded silently, and FusedAdam
    went on as plain Adam (or descended a loss the run was maximizing)."""
    params = [torch.randn(4, requires_grad=True)]
    optimizer = torch.optim.AdamW(params, lr=1e-2, **{option: True})
    _adamw_steps(optimizer, params, 2, seed=0)
    with pytest.raises(ValueError, match=f"{option}=True, which FusedAdam does not implement"):
        FusedAdam([p.detach().clone() for p in params]).load_state_dict(optimizer.state_dict())


@pytest.mark.parametrize("option", ["amsgrad", "maximize"])
def test_a_group_asking_for_an_option_fused_adam_lacks_is_refused(option: str) -> None:
    """Until wave 41 a group's ``maximize=True`` (in the constructor's groups or added later) was
    taken and ignored: FusedAdam descended where torch.optim.Adam climbs."""
    p, q = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=f"a parameter group with {option}=True: FusedAdam does not"):
        FusedAdam([{"params": [p], option: True}], lr=0.1)
    optimizer = FusedAdam([p], lr=0.1)
    with pytest.raises(ValueError, match=f"{option}=True"):
        optimizer.add_param_group({"params": [q], option: True})
    optimizer.add_param_group({"params": [q], option: False})  # asked off: FusedAdam's own algorithm


def _steps_with_gaps(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], steps: int) -> None:
    """Gradients for some parameters only: the first at every step, the second at every other
    step (a head trained on every other batch), the third from step 4 on (unfrozen late)."""
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            has_grad = i == 0 or (i == 1 and step % 2 == 1) or (i == 2 and step >= 4)
            p.grad = g if has_grad else None
        optimizer.step()


@pytest.mark.parametrize("mode", [AdamWMode.ADAM_L2_REGULARIZATION, AdamWMode.ADAMW_TORCH])
def test_each_parameter_counts_its_own_steps_as_torch_adam_does(mode: AdamWMode) -> None:
    """One group, parameters whose gradients come and go. Until wave 31 their bias correction
    counted the group's steps: the head's fourth update was corrected as the group's eighth, and
    the late layer's first as the group's fifth (betas 0.9/0.99: an update 0.54× torch's)."""
    start = [torch.randn(s, generator=torch.Generator().manual_seed(3)) for s in [(6,), (4, 3), (5,)]]
    ours = [p.clone().requires_grad_() for p in start]
    reference = [p.clone().requires_grad_() for p in start]
    fused = FusedAdam(ours, adam_w_mode=mode, **HYPER)
    _steps_with_gaps(fused, ours, 10)
    _steps_with_gaps(_torch_reference(mode, reference), reference, 10)
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b)
    assert [fused.state[p]["step"] for p in ours] == [10, 5, 6]
    assert fused.param_groups[0]["step"] == 10


@pytest.mark.parametrize("first", ["torch", "fused"])
def test_per_parameter_steps_survive_a_move_between_optimizers(first: str) -> None:
    start = [torch.randn(s, generator=torch.Generator().manual_seed(4)) for s in [(6,), (4, 3), (5,)]]
    make = {
        "torch": lambda ps: torch.optim.AdamW(ps, foreach=False, **HYPER),
        "fused": lambda ps: FusedAdam(ps, adam_w_mode=AdamWMode.ADAMW_TORCH, **HYPER),
    }
    second = "fused" if first == "torch" else "torch"
    reference = [p.clone().requires_grad_() for p in start]
    optimizer = make[first](reference)
    _steps_with_gaps(optimizer, reference, 5)
    moved = [p.detach().clone().requires_grad_() for p in reference]
    resumed = make[second](moved)
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    _steps_with_gaps(optimizer, reference, 6)
    _steps_with_gaps(resumed, moved, 6)
    for a, b in zip(moved, reference, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("mode", [AdamWMode.ADAM_L2_REGULARIZATION, AdamWMode.ADAMW_TORCH])
def test_complex_params_are_updated_as_torch_adam_updates_them(mode: AdamWMode) -> None:
    """As pairs of reals (torch's Adam views them so); until wave 36 the fused kernel raised
    "not implemented for 'ComplexFloat'" (a spectral layer's complex weights, FNO-style)."""
    gen = torch.Generator().manual_seed(0)
    params = [
        torch.randn(5, 3, dtype=torch.cfloat, generator=gen).requires_grad_(),
        torch.randn(4).requires_grad_(),
    ]
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    opt, ref_opt = FusedAdam(params, adam_w_mode=mode, **HYPER), _torch_reference(mode, ref_params)
    for _ in range(5):
        grads = [torch.randn(p.shape, dtype=p.dtype, generator=gen) for p in params]
        for group, values in ((params, grads), (ref_params, grads)):
            for p, g in zip(group, values, strict=True):
                p.grad = g.clone()
        opt.step()
        ref_opt.step()
    for p, r in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p.detach(), r.detach(), atol=1e-6, rtol=1e-6)
    assert opt.state[params[0]]["exp_avg"].dtype == torch.cfloat


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_optimizer_keeps_its_mode_and_steps_as_the_original(how: str) -> None:
    """``copy.deepcopy``/``pickle``/``torch.save`` kept only torch's defaults, state and groups: the
    copy's next step raised "no attribute 'adam_w_mode'" (wave 46's review)."""
    import pickle

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(2)]
    optimizer = FusedAdam(
        params, lr=0.1, weight_decay=0.1, adam_w_mode=AdamWMode.ADAMW_TORCH, set_grad_none=False
    )
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    both = (params, optimizer)
    copied_params, copied = copy.deepcopy(both) if how == "deepcopy" else pickle.loads(pickle.dumps(both))
    assert copied.adam_w_mode is AdamWMode.ADAMW_TORCH and copied.set_grad_none is False
    for original, twin in zip(params, copied_params, strict=True):
        twin.grad = original.grad.clone()
    optimizer.step()
    copied.step()
    for original, twin in zip(params, copied_params, strict=True):
        torch.testing.assert_close(twin, original, rtol=0, atol=0)
    copied.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in copied_params)  # zeroed, as asked
