"""Structured records: a batch whose model input is several tensors (Hugging Face's ``input_ids``,
``attention_mask``, ``token_type_ids``, ...; or positional ``(x1, x2, ...)``).

:class:`Fields` holds such a batch as named (a mapping) or positional (a tuple) tensors that share their
leading dimension, one row per record. It behaves as a batch tensor does wherever dpvr treats records as rows
(``len``, row indexing and slicing, ``torch.cat`` through :func:`cat`, ``.to``), and the model is called
with the fields unpacked (:func:`call`, :func:`model_args`): ``model(**fields)`` or ``model(*fields)``. It is
a pytree node, so ``vmap`` maps over every field's rows and ``tree_map`` reaches each field.

Each field belongs to its record: a mask, token type or position row is the record's own, and a record's
gradient is taken with its fields together (clipped as one record). Nothing here reads the values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree


class Fields:
    """The tensors of a batch of records whose input has several parts, each with one row per record.

    Args:
        fields: a mapping of names to tensors (given to the model as keyword arguments) or a sequence of
            tensors (positional arguments), each with a leading dimension of the number of records.

    Raises:
        TypeError: a field is not a tensor (or array), or no field is given.
        ValueError: a field has no leading dimension, or the fields disagree on the number of records.
    """

    __slots__ = ("names", "tensors")

    def __init__(self, fields: Mapping[str, Any] | Sequence[Any]) -> None:
        if isinstance(fields, Fields):
            names, values = fields.names, list(fields.tensors)
        elif isinstance(fields, Mapping):
            names, values = tuple(str(k) for k in fields), list(fields.values())
        elif isinstance(fields, (tuple, list)):
            names, values = None, list(fields)
        else:
            raise TypeError(f"fields: expected a mapping or a sequence of tensors, got "
                            f"{type(fields).__name__}")
        if not values:
            raise TypeError("fields: no field given")
        tensors = []
        for k, v in enumerate(values):
            label = names[k] if names is not None else f"field {k}"
            if not isinstance(v, Tensor):
                try:
                    v = torch.as_tensor(v)
                except (TypeError, ValueError, RuntimeError) as err:
                    raise TypeError(f"data: {label!r} of the records' input is a {type(v).__name__}, not a "
                                    "tensor (each field must collate to one tensor with a row per record)"
                                    ) from err
            if v.dim() == 0:
                raise ValueError(f"data: {label!r} of the records' input has no record dimension (a 0-d "
                                 "tensor); each field needs one row per record")
            tensors.append(v)
        rows = {len(t) for t in tensors}
        if len(rows) > 1:
            shapes = {names[k] if names else k: tuple(t.shape) for k, t in enumerate(tensors)}
            raise ValueError(f"data: the fields of the records' input have different numbers of rows "
                             f"{shapes}; each field needs one row per record")
        self.names: tuple[str, ...] | None = names
        self.tensors: tuple[Tensor, ...] = tuple(tensors)

    @classmethod
    def _unchecked(cls, names: tuple[str, ...] | None, tensors: Sequence[Any]) -> Fields:
        """Fields built without checks (inside ``vmap``, where the rows are not a dimension)."""
        out = cls.__new__(cls)
        out.names, out.tensors = names, tuple(tensors)
        return out

    # ---- rows ----

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, index: Any) -> Any:
        """A field by name (``fields["input_ids"]``), else the same rows of every field."""
        if isinstance(index, str):
            if self.names is None or index not in self.names:
                raise KeyError(index)
            return self.tensors[self.names.index(index)]
        return self.map(lambda t: t[index])

    def map(self, fn: Callable[[Tensor], Any]) -> Fields:
        """``fn`` applied to every field."""
        return Fields._unchecked(self.names, [fn(t) for t in self.tensors])

    def to(self, *args: Any, **kwargs: Any) -> Fields:
        return self.map(lambda t: t.to(*args, **kwargs))

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    # ---- as arguments ----

    def args(self) -> tuple[tuple[Tensor, ...], dict[str, Tensor]]:
        """The model's positional and keyword arguments."""
        if self.names is None:
            return self.tensors, {}
        return (), dict(zip(self.names, self.tensors))

    def items(self) -> Iterator[tuple[str | int, Tensor]]:
        keys: Sequence[str | int] = self.names if self.names is not None else range(len(self.tensors))
        return iter(zip(keys, self.tensors))

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {tuple(t.shape)}" for k, t in self.items())
        return f"Fields({shapes})"


def _flatten(fields: Fields) -> tuple[list[Tensor], tuple[str, ...] | None]:
    return list(fields.tensors), fields.names


def _unflatten(values: Any, names: tuple[str, ...] | None) -> Fields:
    return Fields._unchecked(names, list(values))


pytree.register_pytree_node(Fields, _flatten, _unflatten, serialized_type_name="dpvr.grads.fields.Fields")


def as_inputs(inputs: Any) -> Any:
    """``inputs`` as the algorithms take them: a tensor as it is, a :class:`Fields` as it is, a mapping (a
    dict, a Hugging Face ``BatchEncoding``) or a tuple or list of tensors as :class:`Fields`."""
    if isinstance(inputs, (Tensor, Fields)):
        return inputs
    if isinstance(inputs, (Mapping, tuple, list)):
        return Fields(inputs)
    return inputs


def model_args(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments that give ``inputs`` (a tensor or :class:`Fields`) to a model."""
    if isinstance(inputs, Fields):
        return inputs.args()
    return (inputs,), {}


def call(model: nn.Module | Callable[..., Any], inputs: Any) -> Any:
    """``model`` on ``inputs``: ``model(x)`` for a tensor, the fields unpacked for :class:`Fields`."""
    args, kwargs = model_args(inputs)
    return model(*args, **kwargs)


def cat(parts: Sequence[Any]) -> Any:
    """``torch.cat`` of batches along their records (tensors, or :class:`Fields` field by field)."""
    if isinstance(parts[0], Fields):
        return pytree.tree_map(lambda *ts: torch.cat(ts), *parts)
    return torch.cat(list(parts))


def leaves(*batches: Any) -> list[Tensor]:
    """The tensors of ``batches`` (a tensor, or each field of a :class:`Fields`), in order."""
    return [t for b in batches for t in pytree.tree_leaves(b) if isinstance(t, Tensor)]


def rows(batch: Any) -> int:
    """The number of records of a batch (a tensor's leading dimension, or a :class:`Fields`')."""
    return len(batch)


__all__ = ["Fields", "as_inputs", "call", "cat", "leaves", "model_args", "rows"]
