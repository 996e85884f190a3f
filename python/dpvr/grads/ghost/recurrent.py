"""``nn.RNN``, ``nn.LSTM`` and ``nn.GRU``: the Linear rule applied per time step.

Every recurrent cell is two linear maps per time step, ``W_ih x_t + b_ih`` and ``W_hh h_{t-1} + b_hh``, fed
into the gates. So a weight's per-sample gradient is ``sum_t G_t^T A_t`` over the steps — ``A`` the layer's
inputs ``x_t`` or its previous hidden states ``h_{t-1}``, ``G`` the gradients of the two maps' outputs — an
:class:`~dpvr.grads.ghost.rules.Outer` part whose norm and clipped sum never form the per-sample matrix, as
for a ``Linear`` applied along a sequence.

The recorded forward (:meth:`RecurrentRule.recording_forward`) runs the layer as those parts: the input map
of each layer and direction in one product over all steps, then the recurrence step by step (torch's own
equations and gate order), exposing the input maps' outputs, a zero tensor added to the recurrent maps'
outputs (its gradient is theirs, one tensor for all steps), and the hidden states each step read. Any
configuration it does not cover (packed sequences, ``proj_size``, unbatched input) takes the fallback: one
vector-Jacobian product of the layer per sample (these layers have no ``vmap`` batching rule); there the
input is split at its batch dimension (0 with ``batch_first``, else 1) and states at dimension 1, and
dropout between layers in training mode is refused (the layer would be recomputed with other masks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .fallback import VjpRule
from .rules import Dense, LayerCall, Outer, Part, register_ghost_rule, summed


def _lstm_cell(gates: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    i, f, g, o = gates.chunk(4, dim=-1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


@register_ghost_rule(nn.RNN, nn.LSTM, nn.GRU)
class RecurrentRule(VjpRule):
    loop = True

    @property
    def recorded_as_ghost(self) -> bool:  # type: ignore[override]
        return not getattr(self.module, "proj_size", 0)

    def _batch_dim(self) -> int:
        return 0 if self.module.batch_first else 1

    def in_dim(self, position, leaf, batch):
        if not isinstance(leaf, Tensor):
            return None
        return self._batch_dim() if position in (0, "input") else 1  # the rest is the initial state hx

    def out_dims(self, call: LayerCall) -> list[int | None]:
        return [self._batch_dim()] + [1] * (len(call.grads) - 1)  # output, then h_n (and c_n)

    @property
    def internal_values(self) -> frozenset[str]:  # type: ignore[override]
        m = self.module
        names = (f"{kind}{layer}.{d}" for layer in range(m.num_layers) for d in range(1 + m.bidirectional)
                 for kind in ("x", "h"))
        return frozenset(names)

    def recording_forward(self, args, kwargs):
        m = self.module
        if kwargs or not args or len(args) > 2 or not isinstance(args[0], Tensor) or args[0].dim() != 3:
            return None
        if getattr(m, "proj_size", 0):
            return None
        x = args[0] if m.batch_first else args[0].transpose(0, 1)  # (B, T, I)
        batch, length = x.shape[:2]
        directions, hidden = 1 + m.bidirectional, m.hidden_size
        lstm, gru = isinstance(m, nn.LSTM), isinstance(m, nn.GRU)
        state = args[1] if len(args) > 1 else None
        h0, c0 = (state if lstm else (state, None)) if state is not None else (None, None)
        zeros = x.new_zeros(m.num_layers * directions, batch, hidden)
        h0 = zeros if h0 is None else h0
        c0 = zeros if lstm and c0 is None else c0
        exposed: dict[str, Tensor] = {}
        finals, cells = [], []
        for layer in range(m.num_layers):
            outputs = []
            for d in range(directions):
                suffix = f"_l{layer}" + ("_reverse" if d else "")
                w_ih, w_hh = getattr(m, "weight_ih" + suffix), getattr(m, "weight_hh" + suffix)
                b_ih = getattr(m, "bias_ih" + suffix) if m.bias else None
                b_hh = getattr(m, "bias_hh" + suffix) if m.bias else None
                inputs = F.linear(x, w_ih, b_ih)  # every step's input map at once: (B, T, G)
                added = inputs.new_zeros(inputs.shape).requires_grad_()  # carries the recurrent maps' grads
                # One view per step, taken once: indexing a step at a time would give each step's backward a
                # gradient of the whole (B, T, G) tensor, T times over.
                steps_in, steps_added = inputs.unbind(1), added.unbind(1)
                k = layer * directions + d
                h, c = h0[k], (c0[k] if lstm else None)
                read, out = [None] * length, [None] * length
                for t in (range(length - 1, -1, -1) if d else range(length)):
                    read[t] = h
                    recurrent = F.linear(h, w_hh, b_hh) + steps_added[t]
                    if lstm:
                        h, c = _lstm_cell(steps_in[t] + recurrent, h, c)
                    elif gru:
                        r_i, z_i, n_i = steps_in[t].chunk(3, dim=-1)
                        r_h, z_h, n_h = recurrent.chunk(3, dim=-1)
                        r, z = torch.sigmoid(r_i + r_h), torch.sigmoid(z_i + z_h)
                        h = (1 - z) * torch.tanh(n_i + r * n_h) + z * h
                    else:
                        act = torch.tanh if m.nonlinearity == "tanh" else torch.relu
                        h = act(steps_in[t] + recurrent)
                    out[t] = h
                exposed.update({f"x{layer}.{d}": x.detach(), f"i{layer}.{d}": inputs,
                                f"r{layer}.{d}": added, f"h{layer}.{d}": torch.stack(read, dim=1).detach()})
                outputs.append(torch.stack(out, dim=1))
                finals.append(h)
                cells.append(c)
            x = torch.cat(outputs, dim=-1) if directions > 1 else outputs[0]
            if layer < m.num_layers - 1 and m.dropout > 0 and m.training:
                x = F.dropout(x, m.dropout, training=True)
        output = x if m.batch_first else x.transpose(0, 1)
        h_n = torch.stack(finals)
        return (output, (h_n, torch.stack(cells)) if lstm else h_n), exposed

    def gradient(self, calls: Sequence[LayerCall]) -> dict[str, Part]:
        if not all(c.internal_grads for c in calls):
            # The cuDNN kernels differentiate only in training mode, and the oneDNN (mkldnn) float32 kernels
            # keep a workspace that a functional vjp does not carry; the native kernels differentiate in any
            # mode.
            with torch.backends.cudnn.flags(enabled=False), torch.backends.mkldnn.flags(enabled=False):
                return super().gradient(calls)
        m, parts = self.module, {}
        for layer in range(m.num_layers):
            for d in range(1 + m.bidirectional):
                suffix, key = f"_l{layer}" + ("_reverse" if d else ""), f"{layer}.{d}"
                g_in = [c.internal_grads[f"i{key}"] for c in calls]
                g_rec = [c.internal_grads[f"r{key}"] for c in calls]
                inputs, states = ([c.internals[f"{kind}{key}"] for c in calls] for kind in "xh")
                parts["weight_ih" + suffix] = Outer(list(zip(inputs, g_in)))
                parts["weight_hh" + suffix] = Outer(list(zip(states, g_rec)))
                parts["bias_ih" + suffix] = Dense(summed([g.sum(dim=1) for g in g_in]))
                parts["bias_hh" + suffix] = Dense(summed([g.sum(dim=1) for g in g_rec]))
        return {name: parts[name] for name in self.trainable}

    def check(self, name, call, batch):
        m = self.module
        if not isinstance(call.input, Tensor):
            raise ValueError(f"layer {name!r}: packed sequences are not supported by ghost clipping; pass a "
                             "padded batch (and mask the padded steps in the loss)")
        if call.input.dim() != 3:
            raise ValueError(f"layer {name!r}: unbatched {type(m).__name__} input; pass (batch, ...) inputs")
        if not call.internal_grads and m.training and m.dropout > 0 and m.num_layers > 1:
            raise ValueError(f"layer {name!r}: dropout between recurrent layers in training mode cannot be "
                             "replayed per sample; use dropout=0 or eval mode")
        super().check(name, call, batch)
