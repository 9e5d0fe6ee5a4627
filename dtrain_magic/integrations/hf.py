"""Hugging Face ``transformers.Trainer`` and ``accelerate.Accelerator`` inside a ``%%distribute`` worker.

Both already train inside an initialised torch.distributed group (they use it rather than making
one). What this adds, through hooks run when the user's code imports them:

- ``Trainer.__init__``: ``--precision`` and ``--grad-accum`` fill in ``TrainingArguments`` the user
  left at their defaults (``bf16``/``fp16`` off, ``gradient_accumulation_steps=1``); a different
  explicit value is an `UnsupportedCodeError` (drop the flag or the argument). Then the Trainer's own
  ``MLflowCallback`` (``report_to="mlflow"`` / ``"all"``) is removed, since it would open a second
  MLflow run, and `MagicLogCallback` feeds ``on_log`` (loss, learning_rate, epoch, grad_norm, ...)
  to the magic's run at ``state.global_step``, on rank 0.
- ``Accelerator.log(values, step)`` also reaches the run (rank 0). ``--precision`` and
  ``--grad-accum`` become ``ACCELERATE_MIXED_PRECISION`` / ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``
  defaults, which an explicit ``Accelerator(mixed_precision=...)`` overrides, as accelerate documents.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import UnsupportedCodeError
from . import log_metrics, patch


def set_environment(config: Any) -> None:
    """accelerate's (and TrainingArguments') documented defaults from the run's flags."""
    if config.precision != "fp32":
        os.environ.setdefault("ACCELERATE_MIXED_PRECISION", config.precision)
    if config.grad_accum != 1:
        os.environ.setdefault("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", str(config.grad_accum))


def apply_flags(args: Any, precision: str, grad_accum: int) -> None:
    """Map ``--precision`` / ``--grad-accum`` onto ``TrainingArguments`` (in place). Pure logic."""
    if precision != "fp32":
        chosen = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else None
        if chosen is not None and chosen != precision:
            raise UnsupportedCodeError(
                f"--precision {precision} conflicts with TrainingArguments({chosen}=True); drop one of them"
            )
        setattr(args, precision, True)
        args.mixed_precision = precision
    if grad_accum != 1:
        steps = getattr(args, "gradient_accumulation_steps", 1)
        if steps not in (1, grad_accum):
            raise UnsupportedCodeError(
                f"--grad-accum {grad_accum} conflicts with TrainingArguments(gradient_accumulation_steps={steps}); "
                "drop one of them"
            )
        args.gradient_accumulation_steps = grad_accum


def _callback_class(trainer_callback: Any) -> type:
    class MagicLogCallback(trainer_callback):
        """The Trainer's logs → the ``%%distribute`` run's MLflow run and live charts (rank 0)."""

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and state.is_world_process_zero:
                log_metrics(logs, state.global_step)

    return MagicLogCallback


def patch_trainer(module: Any, config: Any) -> None:
    """Wrap ``transformers.trainer.Trainer.__init__`` (subclasses call it too)."""
    trainer_cls = module.Trainer
    original = trainer_cls.__init__
    callback_cls = _callback_class(module.TrainerCallback)

    def __init__(self: Any, model: Any = None, args: Any = None, *rest: Any, **kwargs: Any) -> None:
        if args is None and (config.precision != "fp32" or config.grad_accum != 1):
            from transformers import TrainingArguments

            args = TrainingArguments(output_dir="tmp_trainer")  # the Trainer's own default, with the flags
        if args is not None:
            apply_flags(args, config.precision, config.grad_accum)
        original(self, model, args, *rest, **kwargs)
        try:
            from transformers.integrations import MLflowCallback

            self.remove_callback(MLflowCallback)  # it would open a second MLflow run
        except ImportError:
            pass
        self.add_callback(callback_cls())

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    patch(trainer_cls, "__init__", __init__)


def patch_accelerator(module: Any) -> None:
    """``Accelerator.log`` → also the run's metrics (rank 0)."""
    accelerator_cls = module.Accelerator
    original = accelerator_cls.log

    def log(self: Any, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> Any:
        if self.is_main_process:
            count = getattr(self, "_dtrain_log_calls", 0)
            self._dtrain_log_calls = count + 1
            log_metrics(values, count if step is None else step)
        return original(self, values, step=step, log_kwargs=log_kwargs)

    patch(accelerator_cls, "log", log)
