"""CTC loss as its alpha (forward) recursion, unrolled over time steps, differentiated by autograd.

PyTorch's ``_ctc_loss`` returns its alpha table sized by the longest target, a value of the
target-lengths tensor: a data-dependent output shape, so capture failed. Here the lattice is
sized by the targets' padded width (a shape) and lengths act as masks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ortrain.capture.autocast_float32 import autocast_to_float32


def _log_add(*terms: torch.Tensor) -> torch.Tensor:
    """log(Σ exp(terms)); -inf where every term is -inf."""
    top = terms[0]
    for term in terms[1:]:
        top = torch.maximum(top, term)
    shift = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    total = sum((torch.exp(term - shift) for term in terms), torch.zeros_like(top))
    some = total > 0
    return torch.where(some, shift + torch.log(torch.where(some, total, torch.ones_like(total))), -math.inf)


def _as_tensor(lengths: Sequence[int] | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if isinstance(lengths, torch.Tensor):
        return lengths.to(device=like.device, dtype=torch.int64)
    # torch.tensor(list) would trace as a lifted constant, which AOTAutograd cannot functionalize.
    return torch.stack([torch.full((), int(n), dtype=torch.int64, device=like.device) for n in lengths])


class _Lattice:
    """The extended label sequence (blank, l1, blank, l2, ..., blank) of each sample."""

    def __init__(
        self,
        log_probs: torch.Tensor,
        targets: torch.Tensor,
        input_lengths: Sequence[int] | torch.Tensor,
        target_lengths: Sequence[int] | torch.Tensor,
        blank: int,
    ) -> None:
        device = log_probs.device
        if targets.dim() == 1:  # concatenated targets, split at the (static) lengths and padded
            assert not isinstance(target_lengths, torch.Tensor)
            starts = [sum(target_lengths[:i]) for i in range(len(target_lengths))]
            width = max([1, *target_lengths])
            targets = torch.stack(
                [
                    torch.nn.functional.pad(targets.narrow(0, start, n), (0, width - n))
                    for start, n in zip(starts, target_lengths, strict=True)
                ]
            )
        self.time_steps, self.batch, _ = log_probs.shape
        width = targets.shape[1]
        self.in_lengths = _as_tensor(input_lengths, log_probs)
        self.out_lengths = _as_tensor(target_lengths, log_probs)
        position = torch.arange(width, device=device)
        # Labels past a target's length become blanks, so that every gather stays in range.
        labels = torch.where(
            position.unsqueeze(0) < self.out_lengths.unsqueeze(1), targets.to(torch.int64), blank
        )
        blanks = torch.full((self.batch, width), blank, dtype=torch.int64, device=device)
        interleaved = torch.stack([blanks, labels], 2).reshape(self.batch, 2 * width)
        edge = torch.full((self.batch, 1), blank, dtype=torch.int64, device=device)
        self.labels = torch.cat([interleaved, edge], 1)  # [N, S'], S' = 2·width + 1
        self.states = 2 * width + 1
        # A label may be reached by skipping the blank before it unless it repeats the label before.
        two = torch.full((self.batch, 2), blank, dtype=torch.int64, device=device)
        before = torch.cat([two, self.labels[:, :-2]], 1)
        self.may_skip = (self.labels != blank) & (self.labels != before)
        index = self.labels.unsqueeze(0).expand(self.time_steps, self.batch, self.states)
        self.emit = log_probs.gather(2, index)  # [T, N, S']
        self.index = index

    def alpha(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The negative log-likelihood [N] and the alpha table [N, T, S']."""
        neg_inf = torch.full((self.batch, 1), -math.inf, dtype=self.emit.dtype, device=self.emit.device)
        state = torch.arange(self.states, device=self.emit.device)
        alpha = torch.where(state < 2, self.emit[0], -math.inf)
        table = [alpha]
        # Where a sample has no steps at all, only the empty alignment ends (at the first blank,
        # with probability 1): wave 48's review found the first step's column read there, a finite
        # loss where eager's is 0 (an empty target) or inf.
        nothing = torch.where(state == 0, 0.0, -math.inf).to(alpha.dtype)
        final = torch.where((self.in_lengths == 0).unsqueeze(1), nothing, alpha)
        for t in range(1, self.time_steps):
            one = torch.cat([neg_inf, alpha[:, :-1]], 1)
            two = torch.where(self.may_skip, torch.cat([neg_inf, neg_inf, alpha[:, :-2]], 1), -math.inf)
            alpha = _log_add(alpha, one, two) + self.emit[t]
            table.append(alpha)
            final = torch.where((self.in_lengths == t + 1).unsqueeze(1), alpha, final)
        last = (2 * self.out_lengths).unsqueeze(1)
        end_blank = final.gather(1, last).squeeze(1)
        end_label = final.gather(1, torch.clamp(last - 1, min=0)).squeeze(1)
        end_label = torch.where(self.out_lengths > 0, end_label, -math.inf)
        return -_log_add(end_blank, end_label), torch.stack(table, 1)


_REDUCTIONS = ("none", "mean", "sum")


def ctc_loss_function(
    log_probs: torch.Tensor,
    targets: torch.Tensor,
    input_lengths: Sequence[int] | torch.Tensor,
    target_lengths: Sequence[int] | torch.Tensor,
    blank: int = 0,
    reduction: str = "mean",
    zero_infinity: bool = False,
) -> torch.Tensor:
    """``torch.nn.functional.ctc_loss`` as the alpha recursion, differentiated by autograd.

    Used while capturing (``capture/function_overrides.py``), above autograd: AOTAutograd's
    metadata pass runs ``_ctc_loss`` itself, below any decomposition table, and fails on its
    data-dependent output shape. Falls back to PyTorch (returns NotImplemented) for concatenated
    targets with tensor lengths, whose split needs the lengths' values.
    """
    if reduction not in _REDUCTIONS or (targets.dim() == 1 and isinstance(target_lengths, torch.Tensor)):
        return NotImplemented
    unbatched = log_probs.dim() == 2
    if unbatched:
        log_probs, targets = log_probs.unsqueeze(1), targets.unsqueeze(0)
        if isinstance(input_lengths, torch.Tensor):
            input_lengths, target_lengths = (
                input_lengths.reshape(1),
                torch.as_tensor(target_lengths).reshape(1),
            )
    log_probs = autocast_to_float32(log_probs)  # ctc_loss is on autocast's float32 list
    lattice = _Lattice(log_probs, targets, input_lengths, target_lengths, blank)
    # PyTorch refuses an input length past the time steps; in the graph the lengths are values.
    torch._assert_async(
        torch.all(lattice.in_lengths <= lattice.time_steps),
        f"Expected input_lengths to have value at most {lattice.time_steps}",
    )
    loss, _ = lattice.alpha()
    # PyTorch's CTC backward returns exp(log_probs) - posteriors, not -posteriors (the gradient
    # for logits under a log_softmax, whose backward maps both to the same result). Add a term
    # whose value is exactly 0 and whose gradient is exp(log_probs) over each sample's steps.
    steps = torch.arange(lattice.time_steps, device=log_probs.device).unsqueeze(1)
    live = (steps < lattice.in_lengths.unsqueeze(0)).unsqueeze(2)
    mass = torch.where(live, torch.exp(log_probs), torch.zeros_like(log_probs)).sum([0, 2])
    exp_term = mass - mass.detach()
    infinite = torch.isinf(loss)
    if zero_infinity:
        exp_term = torch.where(infinite, torch.zeros_like(exp_term), exp_term)
        loss = torch.where(infinite, torch.zeros_like(loss), loss)
    else:
        # A sample no alignment fits (its input shorter than its target needs) has an infinite
        # loss, and PyTorch's backward gives it NaN gradients over its steps (exp(log_probs) -
        # exp(-inf + inf)), where the recursion's autograd gives zeros. Keep PyTorch's: sqrt(0 *
        # mass) is 0 with a NaN gradient (0 * 1/0) on the exp term's steps. The other samples
        # take the root of 1, or its gradient would be NaN too: `where` zeroes the gradient
        # reaching the branch it does not pick, and 0 * 1/0 is still NaN. (wave 35)
        poisoned = torch.sqrt(mass * 0 + (~infinite).to(mass.dtype))
        exp_term = torch.where(infinite, poisoned, exp_term)
    loss = loss + exp_term
    if reduction == "mean":
        return (loss / torch.clamp(lattice.out_lengths, min=1).to(loss.dtype)).mean()
    if reduction == "sum":
        return loss.sum()
    return loss.squeeze(0) if unbatched else loss
