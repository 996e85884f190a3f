"""``validate`` and ``fix``: what dpvr's rules say about a model's modules, before any data is touched.

Per-sample clipping bounds one record's influence on a release only if the forward pass treats records
independently and writes nothing derived from them outside the parameters the noise covers. Some modules
break that by design, whatever the data:

- batch normalisation in training mode normalises each record with the batch's statistics (one record moves
  every other record's output, hence gradient) and writes running statistics into buffers;
- instance normalisation with ``track_running_stats=True`` writes the batch's running statistics into
  buffers that are released with the model, without noise;
- an embedding with ``max_norm`` renormalises, in place and during the forward pass, the rows of the tokens
  it looks up: the released weights then carry which tokens the private records hold.

:func:`validate` lists those (refused by :func:`dpvr.make_private`) and the modules whose trainable parameters
have no ghost rule (they train, through the slower materialised per-sample gradients). :func:`fix` makes
the standard replacements. What no static rule can see (a custom module that writes a buffer, or mixes
records only in training mode) is checked on a probe batch by :mod:`dpvr.trainer.checks`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..grads.ghost import rules

_BATCH_NORMS = (nn.modules.batchnorm._BatchNorm,)
_INSTANCE_NORMS = (nn.modules.instancenorm._InstanceNorm,)


@dataclass(frozen=True)
class Finding:
    """One module that ``make_private`` refuses (``refused``) or runs on a slower path (``slow``)."""

    module: str  # its name in the model ("" for the model itself)
    kind: str  # its class name
    problem: str
    fix: str
    refused: bool

    def __str__(self) -> str:
        where = repr(self.module) if self.module else "the model"
        return f"{where} ({self.kind}): {self.problem}; {self.fix}"


def validate(model: nn.Module) -> list[Finding]:
    """Every module of ``model`` that dpvr refuses or sends to a slow path, with why and the fix.

    Refused modules make :func:`dpvr.make_private` raise (listing all of them); :func:`fix` replaces the ones
    it can. A ``slow`` finding is information only: that module's per-sample gradients are materialised.

    Args:
        model: the model to inspect (not modified, not run).

    Returns:
        One :class:`Finding` per module: its name, type, the problem, the fix, and whether it is refused
        (batch normalisation, instance normalisation tracking running statistics, embeddings with
        ``max_norm``) or only slow (no ghost rule). Empty when the model is accepted as it is.
    """
    findings = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if isinstance(module, _BATCH_NORMS):
            findings.append(Finding(
                name, kind, "normalises each record with its batch's statistics in training mode (records "
                "influence each other, so clipping bounds nothing) and writes them into running buffers",
                "replace it with GroupNorm (dpvr.fix does)", True,
            ))
        elif isinstance(module, _INSTANCE_NORMS) and module.track_running_stats:
            findings.append(Finding(
                name, kind, "writes the batch's running statistics into buffers that are released with the "
                "model without noise", "set track_running_stats=False (dpvr.fix does)", True,
            ))
        elif isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None:
            findings.append(Finding(
                name, kind, "renormalises the looked-up rows in place during the forward pass (max_norm), so "
                "the released weights show which tokens the private records hold",
                "set max_norm=None (dpvr.fix does); clipping bounds each record's update instead", True,
            ))
        elif _owns_trainable(module) and rules.rule_for(module) is None and not _owned_by_rule(model, name):
            findings.append(Finding(
                name, kind, "has no ghost clipping rule", "its per-sample gradients are materialised "
                "(slower; register a rule with dpvr.grads.register_ghost_rule)", False,
            ))
    return findings


def fix(model: nn.Module, *, groups: int = 32) -> list[str]:
    """Makes the refused modules of ``model`` acceptable, in place, and returns what it changed.

    Batch normalisation becomes ``GroupNorm`` with up to ``groups`` groups of at least two channels each
    (affine as before, newly initialised: batch statistics have no per-record equivalent); instance
    normalisation stops tracking running statistics (its buffers are dropped); embeddings lose
    ``max_norm``.

    Args:
        model: the model to change in place (a batch-normalisation layer is replaced inside its parent, so
            ``model`` itself must not be one).
        groups: the most groups a replacing ``GroupNorm`` gets.

    Returns:
        One line per change, ``"name: before -> after"``; empty when nothing needed fixing.
    """
    changes = []
    for name, module in list(model.named_modules()):
        kind = type(module).__name__
        if isinstance(module, _BATCH_NORMS) and name:
            channels = module.num_features
            group_count = _groups(channels, groups)
            replacement = nn.GroupNorm(group_count, channels, eps=module.eps, affine=module.affine)
            if module.affine:
                replacement.to(device=module.weight.device, dtype=module.weight.dtype)
            _replace(model, name, replacement)
            changes.append(f"{name}: {kind}({channels}) -> GroupNorm({group_count}, {channels})")
        elif isinstance(module, _INSTANCE_NORMS) and module.track_running_stats:
            module.track_running_stats = False
            module.running_mean = module.running_var = module.num_batches_tracked = None
            changes.append(f"{name}: {kind} track_running_stats=True -> False")
        elif isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None:
            changes.append(f"{name}: {kind} max_norm={module.max_norm:g} -> None")
            module.max_norm = None
    return changes


def refuse_invalid(model: nn.Module) -> None:
    """Raises ``ValueError`` listing every refused module of ``model`` (see :func:`validate`)."""
    refused = [str(f) for f in validate(model) if f.refused]
    if refused:
        raise ValueError(
            "module: these layers break per-record privacy, whatever the data:\n  - " + "\n  - ".join(refused)
            + "\n(dpvr.fix(model) makes the listed replacements in place)"
        )


def _owns_trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters(recurse=False))


def _owned_by_rule(model: nn.Module, name: str) -> bool:
    """Whether an enclosing module's rule handles this module's parameters (``owns_submodules``)."""
    parts = name.split(".")
    for k in range(len(parts) - 1, -1, -1):
        rule = rules.rule_for(model.get_submodule(".".join(parts[:k])))
        if rule is not None and rule.owns_submodules:
            return True
    return False


def _groups(channels: int, most: int) -> int:
    """The most groups (at most ``most``) that split ``channels`` evenly with at least two channels each: a
    group of one channel has a single value per record on a ``(batch, channels)`` input."""
    return max((g for g in range(1, most + 1) if channels % g == 0 and channels // g >= 2), default=1)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, module)
