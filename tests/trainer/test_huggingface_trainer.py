"""A Hugging Face ``Trainer`` trained privately by dpvr (issue 48): ``dpvr.make_private_trainer(trainer)``
takes the Trainer's model, TrainingArguments, dataset, collator, optimizer and scheduler; dpvr draws, clips,
noises and accounts; epsilon reaches the Trainer's callbacks; checkpoints land in ``output_dir`` and resume;
what dpvr cannot honour is refused by name. Tiny models from configs, random weights."""

from __future__ import annotations

import dp_accounting as dpa
import pytest
import torch
from dp_accounting.pld import pld_privacy_accountant
from torch.utils.data import Dataset

import dpvr

tf = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

V, T, N, DELTA = 40, 10, 64, 1e-5


class Records(Dataset):
    """A tokenised dataset's records: ``input_ids``, ``attention_mask`` and ``labels`` per record."""

    def __init__(self, causal: bool, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, V, (N, T), generator=g)
        lengths = torch.randint(3, T + 1, (N,), generator=g)
        self.mask = (torch.arange(T)[None] < lengths[:, None]).long()
        self.ids = self.ids.masked_fill(self.mask == 0, 0)
        self.labels = (self.ids.masked_fill(self.mask == 0, -100) if causal
                       else torch.randint(0, 3, (N,), generator=g))

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def _bert() -> torch.nn.Module:
    torch.manual_seed(0)
    return tf.BertForSequenceClassification(tf.BertConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=T, num_labels=3))


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_positions=T, n_embd=16, n_layer=2, n_head=2,
                                            bos_token_id=0, eos_token_id=0))


class Logs(tf.TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def _trainer(tmp_path, model=None, causal=False, callbacks=(), **args) -> tf.Trainer:
    arguments = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                     max_steps=4, learning_rate=1e-2, logging_steps=2, save_steps=2, report_to=[],
                     use_cpu=True, disable_tqdm=True)
    return tf.Trainer(model=model if model is not None else _bert(),
                      args=tf.TrainingArguments(**{**arguments, **args}), train_dataset=Records(causal),
                      data_collator=tf.default_data_collator, callbacks=list(callbacks))


def _reproducible() -> dpvr.RuntimeConfig:
    return dpvr.RuntimeConfig(generator=dpvr.NoiseGenerator(7, reproducible=True), sampler_seed=7)


def _pld_epsilon(z: float, q: float, steps: int) -> float:
    acc = pld_privacy_accountant.PLDAccountant(dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps))
    return acc.get_epsilon(DELTA)


def test_a_trainer_trains_privately_with_its_optimizer_schedule_and_logs(tmp_path) -> None:
    logs = Logs()
    trainer = _trainer(tmp_path, callbacks=[logs])
    before = [p.detach().clone() for p in trainer.model.parameters()]
    run = dpvr.make_private_trainer(trainer, epsilon=3.0, delta=DELTA, clip=1.0, public_dataset_size=N)
    private = run.private.algorithm
    # the logical batch is per-device x accumulation (8 of 64), the physical one the per-device batch
    assert private.sampler.batch_size == 8 and private.runtime.chunk_size == 4
    assert run.private.total_steps == 4
    assert isinstance(run.optimizer, torch.optim.AdamW) and run.optimizer is trainer.optimizer
    run.train()
    moved = sum(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters()))
    assert moved >= len(before) - 2  # every trained tensor moves (pooler/unused ones may not)
    # epsilon logged at steps 2 and 4 through the Trainer's callbacks: the accountant's, and dp_accounting's
    logged = [entry for entry in logs.logs if "epsilon" in entry]
    assert [round(e["epoch"] * 8) for e in logged] == [2, 4]  # epoch = step / ceil(64 / 8)
    spent = run.privacy_spent(DELTA)
    assert logged[-1]["epsilon"] == spent.epsilon and spent.neighbouring == "add-remove"
    z = spent.noise_multipliers["gradient"]
    assert spent.epsilon == pytest.approx(_pld_epsilon(z, 8 / N, 4), rel=1e-3)
    assert spent.epsilon == pytest.approx(3.0, rel=2e-2)  # calibrated to spend the budget
    # the Trainer's linear schedule over dpvr's 4 steps: half the rate at step 2, none at step 4
    assert [e["learning_rate"] for e in logged] == pytest.approx([5e-3, 0.0])
    assert "loss" not in logged[-1] and not any(k.startswith("dpvr/") for k in logged[-1])  # no diagnostics


def test_a_causal_lm_trains_with_the_default_token_loss_and_diagnostics_on_request(tmp_path) -> None:
    logs = Logs()
    trainer = _trainer(tmp_path, model=_gpt2(), causal=True, callbacks=[logs], max_steps=2)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    default = dpvr.trainer.huggingface.default_criterion(trainer.model)
    assert isinstance(default, dpvr.TokenLoss) and default.shift  # next-token loss, each record's mean
    run = dpvr.make_private_trainer(trainer, epsilon=3.0, clip=1.0, log_diagnostics=True)
    run.train()
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters()))
    assert "dpvr/loss" in logs.logs[-1] and logs.logs[-1]["epsilon"] == run.privacy_spent().epsilon
    assert run.privacy_spent().neighbouring == "replace-one"  # no public size stated


@pytest.mark.parametrize(("setting", "value", "named"), [
    ("fp16", True, "fp16=True"),
    ("train_sampling_strategy", "group_by_length", "train_sampling_strategy='group_by_length'"),
    ("label_smoothing_factor", 0.1, "label_smoothing_factor"),
    ("gradient_checkpointing", True, "gradient_checkpointing=True"),
])
def test_a_setting_dpvr_cannot_honour_is_refused_by_name(tmp_path, setting, value, named) -> None:
    trainer = _trainer(tmp_path)
    setattr(trainer.args, setting, value)  # set after construction: some are refused on a CPU at construction
    with pytest.raises(ValueError, match=f"make_private_trainer: {named}"):
        dpvr.make_private_trainer(trainer, epsilon=3.0, clip=1.0)
    assert trainer.optimizer is None  # nothing built


def test_every_refusal_is_listed_and_a_custom_loss_or_sampler_is_named(tmp_path) -> None:
    class Custom(tf.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    trainer = Custom(model=_bert(), args=tf.TrainingArguments(str(tmp_path), report_to=[], use_cpu=True),
                     train_dataset=Records(False), data_collator=tf.default_data_collator)
    trainer.args.bf16 = True
    listed = r"(?s)2 settings.*Custom\.compute_loss: overridden.*criterion=.*bf16"
    with pytest.raises(ValueError, match=listed):
        dpvr.make_private_trainer(trainer, epsilon=3.0, clip=1.0)
    with pytest.raises(ValueError, match="batch_size: read from the Trainer"):
        dpvr.make_private_trainer(_trainer(tmp_path), epsilon=3.0, clip=1.0, batch_size=8)


class StopAt(tf.TrainerCallback):
    """Stops training after ``step``: a run interrupted there."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step == self.step
        return control


class Start(tf.TrainerCallback):
    """Records the step and parameters training begins from."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.step, self.params = state.global_step, [p.detach().clone() for p in model.parameters()]


def test_a_checkpoint_in_output_dir_resumes_the_run(tmp_path) -> None:
    whole = dpvr.make_private_trainer(_trainer(tmp_path / "whole"), epsilon=3.0, clip=1.0,
                                      public_dataset_size=N, runtime=_reproducible())
    whole.train()

    # Interrupted after step 2 (its checkpoint written), then rebuilt from the same pieces and resumed.
    cut = dpvr.make_private_trainer(_trainer(tmp_path / "cut", callbacks=[StopAt(2)]), epsilon=3.0, clip=1.0,
                                    public_dataset_size=N, runtime=_reproducible())
    cut.train()
    assert cut.private.steps_done == 2
    at_cut = [p.detach().clone() for p in cut.trainer.model.parameters()]
    assert [p.rsplit("/", 1)[-1] for p in cut.checkpoints()] == ["checkpoint-2.dpvr"]
    start = Start()
    again = dpvr.make_private_trainer(_trainer(tmp_path / "cut", callbacks=[start]), epsilon=3.0, clip=1.0,
                                      public_dataset_size=N, runtime=_reproducible())
    again.train(resume_from_checkpoint=True)
    # it starts from the checkpoint's parameters and scheduler, and runs the remaining 2 steps
    assert start.step == 2 and all(torch.equal(a, b) for a, b in zip(at_cut, start.params))
    assert again.private.steps_done == 4 and again.lr_scheduler.last_epoch == 4
    assert any(not torch.equal(a, b) for a, b in zip(at_cut, again.trainer.model.parameters()))
    # a resume draws fresh noise (never a release's twice), so it ends near, not at, the uninterrupted run;
    # it has spent what that run spent: 4 releases
    assert again.privacy_spent(DELTA).epsilon == pytest.approx(whole.privacy_spent(DELTA).epsilon, rel=1e-9)
    # Going back to step 2 of the finished run: its steps 3 and 4 were released and are charged, so the
    # budget refuses the next release, saying why.
    back = dpvr.make_private_trainer(_trainer(tmp_path / "whole"), epsilon=3.0, clip=1.0,
                                     public_dataset_size=N, runtime=_reproducible())
    with pytest.raises(dpvr.BudgetExhaustedError, match="2 release"):
        back.train(resume_from_checkpoint=whole.checkpoints()[0])
