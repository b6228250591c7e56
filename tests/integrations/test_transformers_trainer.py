"""Hugging Face ``Trainer`` with ``ORTModule``, and ``ortrain.transformers.ORTTrainer``."""

from __future__ import annotations

import inspect
import pickle
from pathlib import Path

import pytest
import torch
from _tiny_gpt2 import tiny_gpt2, token_dataset
from torch import nn

from ortrain import ORTModule

transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (the transformers extra)")

from transformers import GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402


def _args(out: Path, **overrides: object) -> TrainingArguments:
    settings: dict[str, object] = {
        "output_dir": str(out),
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "max_steps": 4,
        "logging_steps": 1,
        "learning_rate": 1e-2,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "seed": 0,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }
    settings.update(overrides)
    cls = settings.pop("args_class", TrainingArguments)
    return cls(**settings)  # type: ignore[operator]


def _losses(trainer: Trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_forward_signature_and_unwrapping_show_the_wrapped_module() -> None:
    import accelerate.utils
    import transformers.modeling_utils
    from accelerate import Accelerator

    for model in (nn.Linear(3, 2), tiny_gpt2()):
        wrapped = ORTModule(model)
        assert inspect.signature(wrapped.forward) == inspect.signature(model.forward)
        # Read off the class too (the Trainer's find_labels / can_return_loss do), in a subclass
        # of ORTModule made for the wrapped class; pickles name ORTModule and that class.
        assert isinstance(wrapped, ORTModule)
        assert type(wrapped).__name__ == f"ORTModule[{type(model).__name__}]"
        assert inspect.signature(type(wrapped).forward) == inspect.signature(type(model).forward)
        assert transformers.utils.find_labels(type(wrapped)) == transformers.utils.find_labels(type(model))
        assert type(pickle.loads(pickle.dumps(wrapped))) is type(wrapped)
        assert wrapped.module is model
        # Looked up through their modules, as the Trainer does (a name imported with from-import
        # before the first ORTModule.forward lookup keeps accelerate's original function).
        assert transformers.modeling_utils.unwrap_model(wrapped) is model
        assert accelerate.utils.extract_model_from_parallel(wrapped) is model
        assert Accelerator(cpu=True).unwrap_model(wrapped) is model
    # Calls, hooks and the class attribute still behave like an ordinary method.
    linear = nn.Linear(3, 2)
    wrapped = ORTModule(linear)
    seen: list[torch.Size] = []
    wrapped.register_forward_hook(lambda _m, _i, out: seen.append(out.shape))
    x = torch.randn(4, 3)
    torch.testing.assert_close(wrapped(x), linear(x))
    torch.testing.assert_close(wrapped.forward(x), linear(x))
    assert seen == [torch.Size([4, 2])]
    assert inspect.signature(ORTModule.forward).parameters.keys() == {"self", "args", "kwargs"}


def test_plain_trainer_trains_like_eager_evaluates_saves_a_loadable_checkpoint_and_resumes(
    tmp_path: Path,
) -> None:
    train, evaluation = token_dataset(16), token_dataset(8, seed=2)
    settings = {"save_strategy": "steps", "save_steps": 2}
    eager = Trainer(
        model=tiny_gpt2(),
        args=_args(tmp_path / "eager", **settings),
        train_dataset=train,
        eval_dataset=evaluation,
    )
    eager.train()
    model = ORTModule(tiny_gpt2())
    args = _args(tmp_path / "run", **settings)
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation)
    # No label_names given: the Trainer reads them off type(model), which shows GPT-2's forward.
    assert trainer.label_names == eager.label_names == ["labels"]
    trainer.train()

    # The same run with and without ortrain logs the same losses. The Trainer rounds them to 4
    # digits; the parameters are compared too (atol: 1% of one AdamW step at lr 1e-2, where Adam
    # turns float noise in near-zero gradients into a step).
    losses, expected = _losses(trainer), _losses(eager)
    assert len(losses) == len(expected) == 4
    for got, want in zip(losses, expected, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want)
    final = _params(model)
    eager_params = _params(eager.model)
    for name, value in final.items():
        torch.testing.assert_close(value, eager_params[name], rtol=1e-4, atol=1e-4)
    # Evaluation and prediction see the labels: a loss, and the label ids beside the logits.
    metrics, expected_metrics = trainer.evaluate(), eager.evaluate()
    assert abs(metrics["eval_loss"] - expected_metrics["eval_loss"]) <= 1e-4 * expected_metrics["eval_loss"]
    predicted, expected_prediction = trainer.predict(evaluation), eager.predict(evaluation)
    assert predicted.label_ids is not None and predicted.label_ids.shape == (8, 16)
    torch.testing.assert_close(
        torch.tensor(predicted.metrics["test_loss"]),
        torch.tensor(expected_prediction.metrics["test_loss"]),
        rtol=1e-4,
        atol=0,
    )

    # The checkpoint is a plain Hugging Face one: from_pretrained loads it, ties the head again.
    checkpoint = tmp_path / "run" / "checkpoint-4"
    assert (checkpoint / "model.safetensors").is_file() and (checkpoint / "config.json").is_file()
    loaded = GPT2LMHeadModel.from_pretrained(checkpoint)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    for name, value in _params(loaded).items():
        torch.testing.assert_close(value, final[name], rtol=0, atol=0)

    # Resuming from step 2 retraces steps 3 and 4 exactly.
    resumed = ORTModule(tiny_gpt2(seed=5))
    trainer = Trainer(model=resumed, args=args, train_dataset=train, eval_dataset=evaluation)
    trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert trainer.state.global_step == 4
    for name, value in _params(resumed).items():
        torch.testing.assert_close(value, final[name], rtol=1e-5, atol=1e-6)


def test_plain_trainer_with_bf16_mixed_precision_trains_like_eager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``bf16=True``: accelerate wraps the model's forward in CPU autocast, under which ortrain
    captures (autocast is part of the graph key). ONNX Runtime's CPU build lacks most bfloat16
    kernels: the default policy runs those operators in PyTorch, naming them once."""
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    train = token_dataset(16)
    eager = Trainer(model=tiny_gpt2(), args=_args(tmp_path / "eager", bf16=True), train_dataset=train)
    eager.train()
    model = ORTModule(tiny_gpt2())
    trainer = Trainer(model=model, args=_args(tmp_path / "run", bf16=True), train_dataset=train)
    trainer.train()
    assert any(key.autocast == ("cpu", torch.bfloat16) for key, _ in model._ortrain_graphs.items())
    losses, expected = _losses(trainer), _losses(eager)
    assert len(losses) == len(expected) == 4
    for got, want in zip(losses, expected, strict=True):
        assert abs(got - want) <= 1e-3 * abs(want)  # bfloat16 rounds to 3 significant digits


def test_ort_trainer_fused_adam_accumulation_checkpointing_eval_save_limit_resume(tmp_path: Path) -> None:
    from ortrain.optim import FusedAdam
    from ortrain.transformers import ORTTrainer, ORTTrainingArguments

    train, evaluation = token_dataset(32), token_dataset(8, seed=2)
    common = {
        "gradient_accumulation_steps": 2,
        "weight_decay": 0.01,
        "eval_strategy": "steps",
        "eval_steps": 2,
        "save_strategy": "steps",
        "save_steps": 2,
        "save_total_limit": 1,
    }
    reference = Trainer(
        model=tiny_gpt2(),
        args=_args(tmp_path / "eager", optim="adamw_torch", **common),
        train_dataset=train,
        eval_dataset=evaluation,
    )
    reference.train()

    ort_args = _args(
        tmp_path / "ort",
        args_class=ORTTrainingArguments,
        optim="adamw_ort_fused",
        gradient_checkpointing=True,
        **common,
    )
    assert ort_args.optim == "adamw_ort_fused"
    trainer = ORTTrainer(model=tiny_gpt2(), args=ort_args, train_dataset=train, eval_dataset=evaluation)
    assert isinstance(trainer.model, ORTModule)
    trainer.train()
    assert isinstance(trainer.optimizer.optimizer, FusedAdam)  # the Trainer wraps it in accelerate's
    assert trainer.model.module.transformer.gradient_checkpointing
    for a, b in zip(_losses(trainer), _losses(reference), strict=True):
        assert abs(a - b) <= 1e-4 * abs(b)
    eval_losses = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    reference_eval = [e["eval_loss"] for e in reference.state.log_history if "eval_loss" in e]
    assert len(eval_losses) == 2
    torch.testing.assert_close(torch.tensor(eval_losses), torch.tensor(reference_eval), rtol=1e-4, atol=0)
    # save_total_limit=1 keeps the newest checkpoint only.
    assert sorted(p.name for p in (tmp_path / "ort").glob("checkpoint-*")) == ["checkpoint-4"]
    final = _params(trainer.model)

    # Resume into a longer run: steps 5 and 6 continue from the saved optimizer state.
    # No evaluation in it: the evaluation graph is checked above, and it would be captured again.
    longer = _args(
        tmp_path / "ort",
        args_class=ORTTrainingArguments,
        optim="adamw_ort_fused",
        max_steps=6,
        **{**common, "eval_strategy": "no"},
    )
    resumed = ORTTrainer(model=tiny_gpt2(seed=3), args=longer, train_dataset=train, eval_dataset=evaluation)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6
    assert any(not torch.equal(p, final[n]) for n, p in _params(resumed.model).items())
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "ort" / "checkpoint-6")
    for name, value in _params(loaded).items():
        torch.testing.assert_close(value, _params(resumed.model)[name], rtol=0, atol=0)


def test_ort_trainer_wraps_what_model_init_makes_and_refuses_options_it_cannot_apply(tmp_path: Path) -> None:
    """``model_init`` (the Trainer's path for hyperparameter search): until wave 41 the models it
    made trained in eager PyTorch, without a word; ``debug_options`` with a model already wrapped
    were dropped (no ONNX file was saved)."""
    from ortrain import DebugOptions
    from ortrain.transformers import ORTTrainer

    train = token_dataset(16)
    reference = Trainer(model_init=lambda: tiny_gpt2(), args=_args(tmp_path / "eager"), train_dataset=train)
    reference.train()
    trainer = ORTTrainer(model_init=lambda: tiny_gpt2(), args=_args(tmp_path / "ort"), train_dataset=train)
    trainer.train()
    assert isinstance(trainer.model, ORTModule) and trainer.model._ortrain_graphs
    for a, b in zip(_losses(trainer), _losses(reference), strict=True):
        assert abs(a - b) <= 1e-4 * abs(b)
    with pytest.raises(ValueError, match=r"already wrapped: pass them to ORTModule\(model, debug_options\)"):
        ORTTrainer(model=ORTModule(tiny_gpt2()), args=_args(tmp_path / "x"), debug_options=DebugOptions())


def test_import_ortrain_does_not_import_transformers() -> None:
    import subprocess
    import sys

    code = (
        "import sys, torch; from ortrain import ORTModule; m = ORTModule(torch.nn.Linear(2, 2)); m.forward; "
        "import ortrain.cli, ortrain.bench; "
        "names = ('transformers', 'accelerate', 'deepspeed', 'matplotlib'); "
        "print(sorted(k for k in names if k in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
