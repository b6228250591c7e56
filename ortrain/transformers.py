"""Hugging Face integration: ``ORTTrainer`` / ``ORTTrainingArguments``, drop-ins for the Trainer.

``ORTTrainer`` wraps the model in :class:`~ortrain.ortmodule.ORTModule` itself, so the loss the
model computes from ``labels`` is part of the captured graph (the sparsity optimizers see the
labels), and ``ORTTrainingArguments(optim="adamw_ort_fused")`` trains with
:class:`ortrain.optim.FusedAdam`. Everything else (gradient accumulation, evaluation, checkpoints,
``save_total_limit``, resuming, ``gradient_checkpointing=True``) is the Trainer's own.

``transformers`` is an optional dependency (``pip install "ortrain[transformers]"``): it is imported
here only, never by ``import ortrain``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

try:
    from transformers import Trainer, TrainingArguments
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'ortrain.transformers needs transformers and accelerate: pip install "ortrain[transformers]"'
    ) from error

from torch import nn

from ortrain.optim import AdamWMode, FusedAdam
from ortrain.ortmodule import DebugOptions, ORTModule

__all__ = ["ORT_FUSED_ADAM", "ORTTrainer", "ORTTrainingArguments"]

# The optimizer name ``ORTTrainingArguments`` adds to the Trainer's list.
ORT_FUSED_ADAM = "adamw_ort_fused"


@dataclass
class ORTTrainingArguments(TrainingArguments):
    """``TrainingArguments`` that also accept ``optim="adamw_ort_fused"`` (ortrain's FusedAdam)."""

    def __post_init__(self) -> None:
        ort_optim = str(self.optim) == ORT_FUSED_ADAM
        if ort_optim:
            # TrainingArguments validates ``optim`` against its own enum; let it validate the rest.
            self.optim = "adamw_torch"
        super().__post_init__()
        if ort_optim:
            self.optim = ORT_FUSED_ADAM


class ORTTrainer(Trainer):
    """``transformers.Trainer`` that trains the model on ONNX Runtime.

    The model may be given plain (it is wrapped here), already wrapped in ``ORTModule``, or made by
    ``model_init`` (each model it makes is wrapped: hyperparameter search trains every trial on
    ONNX Runtime); ``debug_options`` go to the ``ORTModule`` this trainer creates.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        *more: Any,
        debug_options: DebugOptions | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(model, ORTModule) and debug_options is not None:
            # Until wave 41 they were dropped without a word (no ONNX files were saved).
            raise ValueError(
                "ORTTrainer(debug_options=...) configures the ORTModule the trainer creates, and this "
                "model is already wrapped: pass them to ORTModule(model, debug_options) instead"
            )
        self._ortrain_debug_options = debug_options  # before the Trainer calls model_init
        if model is not None and not isinstance(model, ORTModule):
            model = ORTModule(model, debug_options)
        # The Trainer reads label names off type(model): ORTModule's subclass for the wrapped class
        # shows the wrapped forward (ortrain/ortmodule/signature.py), so evaluation reports a loss.
        super().__init__(model, args, *more, **kwargs)

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """The model ``model_init`` makes, wrapped in ``ORTModule`` (until wave 41 such a trainer
        trained it in eager PyTorch, without a word)."""
        model = super().call_model_init(trial)
        if isinstance(model, ORTModule):
            return model
        return ORTModule(model, self._ortrain_debug_options)

    @staticmethod
    def get_optimizer_cls_and_kwargs(
        args: TrainingArguments, model: nn.Module | None = None
    ) -> tuple[Any, Any]:
        if str(args.optim) == ORT_FUSED_ADAM:
            # The Trainer's "adamw_torch" semantics (decoupled decay, torch.optim.AdamW), fused.
            return FusedAdam, {
                "lr": args.learning_rate,
                "betas": (args.adam_beta1, args.adam_beta2),
                "eps": args.adam_epsilon,
                "adam_w_mode": AdamWMode.ADAMW_TORCH,
            }
        return Trainer.get_optimizer_cls_and_kwargs(args, model)
