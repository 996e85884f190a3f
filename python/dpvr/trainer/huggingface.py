"""A Hugging Face ``transformers.Trainer`` trained privately by dpvr: ``make_private_trainer(trainer, ...)``.

The user builds the ``Trainer`` as usual (model, ``TrainingArguments``, train dataset, data collator,
optimizers, callbacks); :func:`make_private_trainer` reads those pieces and hands them to
:func:`dpvr.make_private`, so that dpvr draws the batches, clips each record's gradient, adds the noise and
accounts for it, while the ``Trainer``'s optimizer and learning-rate scheduler step on what dpvr released,
its callbacks receive the logs (epsilon among them) and its ``output_dir`` receives dpvr's checkpoints.

``transformers`` is imported only when this is called: it is not a dependency of dpvr.

What maps to what:

- the logical (accounted) batch is ``per_device_train_batch_size * gradient_accumulation_steps``, the
  expected batch size of dpvr's sampler (Poisson by default); the physical batch is
  ``per_device_train_batch_size``, as ``RuntimeConfig(chunk_size=)``;
- the run's length is ``max_steps`` when it is > 0, else ``num_train_epochs`` (dpvr's epochs: the
  sampler's own, :func:`dpvr.optim.sampling.steps_per_epoch`);
- the optimizer and scheduler are the ones the ``Trainer`` creates (``create_optimizer``,
  ``create_scheduler`` over dpvr's planned steps), and ``max_grad_norm`` clips the released batch gradient
  before the optimizer steps, as the ``Trainer`` would: all post-processing of the release;
- logs go through ``Trainer.log`` (so to every callback and ``report_to`` integration) every
  ``logging_steps``: ``learning_rate``, ``epsilon`` (spent so far) and ``epoch``; the training loss and
  dpvr's other diagnostics are computed from private data without noise, so they are logged only with
  ``log_diagnostics=True`` (as ``dpvr/<entry>``, for the data holder: not to be published);
- checkpoints are dpvr's (:meth:`dpvr.optim.PrivateAlgorithm.save_checkpoint`: parameters, optimizer,
  accountant, sampler, run ledger) as ``checkpoint-<step>.dpvr`` in ``output_dir`` every ``save_steps``
  (``save_strategy="steps"``) or epoch (``"epoch"``), with the scheduler beside it; ``save_total_limit``
  keeps the newest; ``train(resume_from_checkpoint=True)`` resumes from the newest.

What the ``Trainer`` offers and dpvr cannot honour privately is refused when the run is built, naming the
setting: a sampler of its own (``train_sampling_strategy`` other than ``"random"``, or a subclass overriding
``_get_train_sampler``/``get_train_dataloader``), ``fp16``/``bf16`` (no sensitivity bound is established
for half-precision per-record gradients), data parallelism through ``accelerate`` (``world_size > 1``,
DeepSpeed, FSDP: give dpvr a process group instead), ``torch_compile``, ``gradient_checkpointing``, a loss
of the ``Trainer``'s own (``compute_loss_func``, a ``compute_loss`` override or ``label_smoothing_factor``;
give ``criterion=``), ``model_init`` and ``load_best_model_at_end``, ``push_to_hub``, and an
``eval_strategy`` other than ``"no"`` (evaluate the released model yourself with ``trainer.evaluate()``).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import pickle
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..optim import RuntimeConfig
from .collate import recordwise
from .losses import TokenLoss
from .trainer import PrivateTrainer, _scalars, make_private

CHECKPOINT = re.compile(r"^checkpoint-(\d+)\.dpvr$")


def _refusals(trainer: Any) -> list[str]:
    """The ``Trainer``'s settings dpvr cannot honour privately, each named with the reason."""
    import transformers  # optional, as in every function here: only a Trainer's owner has it

    args, base, kind = trainer.args, transformers.Trainer, type(trainer)
    problems = []
    if getattr(args, "train_sampling_strategy", "random") != "random":
        problems.append(f"train_sampling_strategy={args.train_sampling_strategy!r}: dpvr draws the batches "
                        "itself (its sampling is part of the accounting); leave it 'random'")
    for method in ("_get_train_sampler", "get_train_dataloader", "training_step", "compute_loss"):
        if getattr(kind, method, None) is not getattr(base, method, None):
            what = "loss" if method == "compute_loss" else "batches"
            problems.append(f"{kind.__name__}.{method}: overridden; dpvr forms the {what} itself and would "
                            "ignore it" + ("; give criterion= instead" if what == "loss" else ""))
    if args.fp16 or args.bf16:
        problems.append(f"{'fp16' if args.fp16 else 'bf16'}=True: no sensitivity bound is established for "
                        "half-precision per-record gradients; train in float32")
    if args.world_size > 1 or getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        problems.append("data parallelism through accelerate (world_size > 1, deepspeed or fsdp): dpvr's "
                        "data-parallel run needs a torch.distributed process group (make_private's "
                        "process_group=) so that every process draws the same batches and noise")
    for name, reason in (
        ("torch_compile", "dpvr's per-record gradient hooks are not checked under torch.compile"),
        ("gradient_checkpointing", "dpvr's per-record gradient hooks are not checked with recomputation"),
        ("load_best_model_at_end", "choosing a model by its evaluation is not part of what dpvr releases"),
        ("push_to_hub", "not built: publish the released model yourself after training"),
    ):
        if getattr(args, name, False):
            problems.append(f"{name}=True: {reason}")
    if str(getattr(args.eval_strategy, "value", args.eval_strategy)) != "no":
        problems.append(f"eval_strategy={args.eval_strategy!r}: not built; call trainer.evaluate() on the "
                        "released model after (or between) dpvr's steps")
    if getattr(args, "label_smoothing_factor", 0.0):
        problems.append("label_smoothing_factor: the Trainer's own loss is not used; give criterion= (e.g. "
                        "nn.CrossEntropyLoss(label_smoothing=...))")
    if getattr(trainer, "compute_loss_func", None) is not None:
        problems.append("compute_loss_func: the Trainer's own loss is not used; give criterion= (any "
                        "(output, labels) -> loss that is a mean or sum of per-record losses)")
    if getattr(trainer, "model_init", None) is not None:
        problems.append("model_init: dpvr trains the model the Trainer holds; build the Trainer with model=")
    if trainer.train_dataset is None:
        problems.append("train_dataset: the Trainer has none")
    return problems


def default_criterion(model: nn.Module) -> Callable[..., torch.Tensor]:
    """The per-record loss dpvr clips, for the Hugging Face heads whose loss is standard: a causal LM's
    next-token cross-entropy (``TokenLoss("record", shift=True)``: each record's mean over its own tokens,
    not the Trainer's mean over the batch's tokens), a masked LM's or token classifier's
    (``TokenLoss("record")``), a sequence classifier's cross-entropy, binary cross-entropy or squared error
    (by ``config.problem_type``/``num_labels``, as the model would). Any other model needs ``criterion=``."""
    name, config = type(model).__name__, getattr(model, "config", None)
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return TokenLoss("record", shift=True)
    if name.endswith(("ForMaskedLM", "ForTokenClassification")):
        return TokenLoss("record")
    if name.endswith("ForSequenceClassification") and config is not None:
        problem = getattr(config, "problem_type", None)
        if problem == "regression" or (problem is None and config.num_labels == 1):
            return lambda out, y: nn.functional.mse_loss(out.logits.squeeze(-1), y.to(out.logits.dtype))
        if problem == "multi_label_classification":
            return lambda out, y: nn.functional.binary_cross_entropy_with_logits(out.logits,
                                                                                   y.to(out.logits.dtype))
        return nn.CrossEntropyLoss()
    raise ValueError(f"criterion: no default per-record loss for {name}; give criterion= (any "
                     "(output, labels) -> loss that is a mean or sum of per-record losses)")


class PrivateHFTrainer:
    """A ``transformers.Trainer``'s run, trained by dpvr (built by :func:`make_private_trainer`).

    Attributes:
        trainer: the user's ``transformers.Trainer`` (its ``state``, ``log_history`` and callbacks are used).
        private: the :class:`~dpvr.trainer.PrivateTrainer` that runs and accounts for every release.
        optimizer, lr_scheduler: the ones the ``Trainer`` created, stepping on dpvr's releases.

    Guarantee: :func:`make_private`'s for the algorithm run (``privacy_spent()`` reports it); the optimizer,
    scheduler, ``max_grad_norm``, the logged ``epsilon``/``learning_rate`` and the checkpoints' parameters
    are post-processing of released values. ``log_diagnostics=True`` logs quantities computed from private
    data without noise (the training loss): they are not covered and must not be published.
    """

    def __init__(self, trainer: Any, private: PrivateTrainer, *, log_diagnostics: bool) -> None:
        self.trainer, self.private = trainer, private
        self.optimizer, self.lr_scheduler = trainer.optimizer, trainer.lr_scheduler
        self.log_diagnostics = log_diagnostics

    def privacy_spent(self, delta: float | None = None):
        return self.private.privacy_spent(delta)

    def checkpoints(self) -> list[str]:
        """The dpvr checkpoint files in ``output_dir``, oldest first."""
        found = [(int(m.group(1)), p) for p in glob.glob(os.path.join(self.trainer.args.output_dir, "*"))
                 if (m := CHECKPOINT.match(os.path.basename(p)))]
        return [p for _, p in sorted(found)]

    def save_checkpoint(self) -> str:
        """Writes ``checkpoint-<step>.dpvr`` (dpvr's) and ``checkpoint-<step>.scheduler.pt`` into
        ``output_dir``; keeps the newest ``save_total_limit``. The run ledger stays beside them."""
        args = self.trainer.args
        os.makedirs(args.output_dir, exist_ok=True)
        path = os.path.join(args.output_dir, f"checkpoint-{self.private.steps_done}.dpvr")
        self.private.save_checkpoint(path)
        side = {"scheduler": self.lr_scheduler.state_dict(), "log_history": self.trainer.state.log_history}
        torch.save(side, path[: -len(".dpvr")] + ".scheduler.pt")
        limit = args.save_total_limit
        for old in self.checkpoints()[: -limit] if limit else ():
            os.remove(old)
            if os.path.exists(old[: -len(".dpvr")] + ".scheduler.pt"):
                os.remove(old[: -len(".dpvr")] + ".scheduler.pt")
        return path

    def load_checkpoint(self, path: str) -> None:
        """Restores a :meth:`save_checkpoint` file (dpvr's resume: the releases made after it are charged
        from the run ledger) and the scheduler saved beside it."""
        # The side file first (plain tensors and numbers only): a missing or unreadable one changes nothing.
        side_path = path[: -len(".dpvr")] + ".scheduler.pt"
        try:
            side = torch.load(side_path, weights_only=True)
            scheduler, history = side["scheduler"], list(side["log_history"])
        except (OSError, RuntimeError, KeyError, TypeError, pickle.UnpicklingError) as err:
            raise ValueError(f"{side_path}: not the scheduler state saved beside {path} ({err!r})") from None
        self.private.load_checkpoint(path)
        self.lr_scheduler.load_state_dict(scheduler)
        self.trainer.state.log_history = history

    def train(self, resume_from_checkpoint: str | bool | None = None) -> dict[str, float]:
        """Runs the planned steps (from a checkpoint: a path, or ``True`` for the newest in ``output_dir``),
        with the ``Trainer``'s callbacks, logs and checkpoints; returns the last logs (``epsilon`` in it)."""
        import transformers  # optional, as everywhere in this module

        trainer, args, private = self.trainer, self.trainer.args, self.private
        per_epoch = private.steps_per_epoch
        trainer.state = transformers.TrainerState(
            max_steps=private.total_steps, logging_steps=args.logging_steps, save_steps=args.save_steps,
            num_train_epochs=-(-private.total_steps // per_epoch),
            train_batch_size=args.per_device_train_batch_size,
        )
        if resume_from_checkpoint:
            if resume_from_checkpoint is True:
                found = self.checkpoints()
                if not found:
                    raise FileNotFoundError(f"resume_from_checkpoint: no checkpoint-<step>.dpvr in "
                                            f"{args.output_dir}")
                resume_from_checkpoint = found[-1]
            self.load_checkpoint(str(resume_from_checkpoint))
        state, control, callbacks = trainer.state, trainer.control, trainer.callback_handler
        state.global_step = private.steps_done
        trainer.control = control = callbacks.on_train_begin(args, state, control)
        logs: dict[str, float] = {}
        save = str(getattr(args.save_strategy, "value", args.save_strategy))
        log_every = str(getattr(args.logging_strategy, "value", args.logging_strategy))
        while private.steps_done < private.total_steps:
            control = callbacks.on_step_begin(args, state, control)
            info = private.step()
            self.lr_scheduler.step()  # the Trainer's schedule, one step per release
            state.global_step, state.epoch = private.steps_done, private.steps_done / per_epoch
            control = callbacks.on_step_end(args, state, control)
            step, last = private.steps_done, private.steps_done == private.total_steps
            epoch_end = step % per_epoch == 0
            due = step % args.logging_steps == 0 if log_every == "steps" else epoch_end
            if (log_every != "no" and (due or last)) or control.should_log:
                logs = {"learning_rate": float(self.lr_scheduler.get_last_lr()[0]),
                        "epsilon": float(private.privacy_spent().epsilon)}
                if self.log_diagnostics:
                    logs.update({f"dpvr/{k}": v for k, v in _scalars(info).items()})
                trainer.log(logs)
                control.should_log = False
            if (save == "steps" and step % args.save_steps == 0) or (save == "epoch" and epoch_end) \
                    or (save != "no" and last) or control.should_save:
                self.save_checkpoint()
                control = callbacks.on_save(args, state, control)
                control.should_save = False
            if control.should_training_stop:
                break
        trainer.control = callbacks.on_train_end(args, state, control)
        return logs

    def close(self) -> None:
        self.private.close()


def make_private_trainer(
    trainer: Any,
    *,
    epsilon: float | None = None,
    delta: float | None = None,
    clip: float,
    criterion: Callable[..., torch.Tensor] | None = None,
    algorithm: str = "dp-sgd",
    public_dataset_size: int | None = None,
    runtime: RuntimeConfig | None = None,
    log_diagnostics: bool = False,
    **settings: Any,
) -> PrivateHFTrainer:
    """The user's ``transformers.Trainer`` trained privately by dpvr; ``.train()`` runs it.

    Args:
        trainer: a ``transformers.Trainer`` built as usual (model, ``args``, ``train_dataset``,
            ``data_collator``, optionally ``optimizers=`` and ``callbacks=``).
        epsilon, delta: the run's budget (as :func:`dpvr.make_private`; ``noise_multiplier=`` may be given in
            ``settings`` instead of or beside ``epsilon``).
        clip: the per-record clip radius (dpvr's ``clip``; the Trainer's ``max_grad_norm`` is a different
            thing, the norm of the released batch gradient, and is applied to it as the Trainer would).
        criterion: the per-record loss; default :func:`default_criterion` for the model's head.
        algorithm: a :func:`dpvr.make_private` algorithm that steps with an optimizer (default
            ``"dp-sgd"``).
        public_dataset_size: the train dataset's size stated public (add/remove accounting); without it
            the run is accounted under replace-one.
        runtime: dpvr's :class:`~dpvr.optim.RuntimeConfig`; its ``chunk_size`` defaults to
            ``per_device_train_batch_size``.
        log_diagnostics: also log dpvr's per-step diagnostics (the training loss among them), computed from
            private data without noise: for the data holder only.
        **settings: further :func:`dpvr.make_private` settings (``accountant``, ``noise_multiplier``,
            ``sampling``, ...).

    Raises:
        ValueError: a ``Trainer`` setting dpvr cannot honour privately (every one listed, each named with
            why: module documentation), or any :func:`dpvr.make_private` refusal.
        TypeError: ``trainer`` is not a ``transformers.Trainer``.

    Guarantee: :func:`dpvr.make_private`'s: the run is ``(epsilon, delta)``-DP with respect to the
    iterates the algorithm releases, under its neighbouring relation (``privacy_spent()`` says which);
    everything the ``Trainer`` does with them (optimizer, scheduler, ``max_grad_norm``, logs of
    ``epsilon`` and ``learning_rate``, checkpoints) is post-processing.
    """
    import transformers  # optional, as everywhere in this module

    if not isinstance(trainer, transformers.Trainer):
        raise TypeError(f"trainer: expected a transformers.Trainer, got {type(trainer).__name__}")
    for name in ("optimizer", "batch_size", "epochs", "steps", "lr"):
        if name in settings:
            raise ValueError(f"{name}: read from the Trainer (its optimizer, TrainingArguments' batch sizes, "
                             "num_train_epochs/max_steps, learning_rate); set it there")
    problems = _refusals(trainer)
    if len(problems) == 1:
        raise ValueError(f"make_private_trainer: {problems[0]}")
    if problems:
        raise ValueError(f"make_private_trainer: {len(problems)} settings dpvr cannot honour privately:\n  - "
                         + "\n  - ".join(problems))
    args, model = trainer.args, trainer.model
    criterion = default_criterion(model) if criterion is None else criterion
    physical = args.per_device_train_batch_size
    logical = physical * args.gradient_accumulation_steps
    loader = _training_loader(trainer, logical)
    runtime = runtime or RuntimeConfig()
    if runtime.chunk_size is None:
        runtime = dataclasses.replace(runtime, chunk_size=physical)
    length = {"steps": args.max_steps} if args.max_steps > 0 else {"epochs": args.num_train_epochs}
    optimizer = trainer.create_optimizer()  # the Trainer's choice (or the one given with optimizers=)
    with warnings.catch_warnings():  # dpvr's sampler replaces the loader's: this module says so already
        warnings.filterwarnings("ignore", message="make_private: dpvr samples batches itself")
        private = make_private(model, criterion, loader, algorithm=algorithm, epsilon=epsilon, delta=delta,
                               optimizer=optimizer, batch_size=logical, runtime=runtime, clip=clip,
                               public_dataset_size=public_dataset_size, **length, **settings)
    trainer.create_scheduler(num_training_steps=private.total_steps, optimizer=optimizer)
    if args.max_grad_norm and args.max_grad_norm > 0:
        _clip_released_gradient(optimizer, args.max_grad_norm)
    return PrivateHFTrainer(trainer, private, log_diagnostics=log_diagnostics)


def _training_loader(trainer: Any, batch_size: int) -> DataLoader:
    """The ``Trainer``'s training data as a ``DataLoader`` of ``batch_size`` records (whose sampler dpvr
    replaces), with the ``Trainer``'s column pruning and a record-wise default collator."""
    import transformers  # optional, as everywhere in this module

    args, dataset = trainer.args, trainer.train_dataset
    try:  # a datasets.Dataset: the Trainer's own column pruning (the model's forward arguments and labels)
        import datasets  # optional: a datasets.Dataset exists only where it is installed

        if isinstance(dataset, datasets.Dataset) and args.remove_unused_columns:
            dataset = trainer._remove_unused_columns(dataset, description="training")
    except ImportError:
        pass
    collate = trainer.data_collator
    if collate is transformers.default_data_collator or isinstance(collate, transformers.DefaultDataCollator):
        # It stacks each field of each record (renaming label to labels): record-wise, and checked so on the
        # first records by make_private. Any other collator is the user's to declare (dpvr.recordwise).
        collate = recordwise(collate)
    return DataLoader(dataset, batch_size=batch_size, collate_fn=collate,
                      num_workers=args.dataloader_num_workers)


def _clip_released_gradient(optimizer: torch.optim.Optimizer, max_norm: float) -> None:
    """The ``Trainer``'s ``max_grad_norm`` clip, on the released (noisy) gradient before each step:
    post-processing. Registered once, should the ``Trainer`` be made private again."""
    if getattr(optimizer, "_dpvr_max_grad_norm", False):
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def clip_released(*_: Any) -> None:
        torch.nn.utils.clip_grad_norm_(params, max_norm)

    optimizer.register_step_pre_hook(clip_released)
    optimizer._dpvr_max_grad_norm = True


__all__ = ["PrivateHFTrainer", "default_criterion", "make_private_trainer"]
