"""Ghost clipping: clipped sums of per-sample gradients, and of same-sample gradient differences, formed from
each layer's activations and output gradients without per-sample gradients.

Loss contract: as :func:`dpvr.grads.per_sample_grads`, ``loss_fn(output, target) -> scalar`` for ONE sample
(``output`` without its batch dimension). Here the model runs once on the whole batch and ``loss_fn`` is
vmapped over it; the backward pass is of the *sum* of the per-sample losses, so row i of the gradient that a
layer's output receives is sample i's own. Every layer must keep the samples apart (batch norm is rejected).

At each parameter point, one forward pass (``torch.func.functional_call``) records the inputs of every tracked
layer and one backward pass asks autograd for the gradients of the layer outputs only (no parameter gradient
is formed). Each tracked module then has a *rule* (:class:`GhostRule`, chosen by the module's exact type from
a registry: :func:`register_ghost_rule`) that expresses its per-sample gradient as parts — outer products
of activations and output gradients, table rows, or materialised vectors (:mod:`.rules`):

- ghost rules (:mod:`.linear`: ``Linear``, ``Conv1d/2d/3d``; :mod:`.embedding`: ``Embedding``,
  ``EmbeddingBag``; :mod:`.normalization`: ``LayerNorm``, ``GroupNorm``, ``RMSNorm``) form no per-sample
  gradient of a weight matrix: its norm comes from the Gram or the direct form and its clipped sum is a
  matmul of the recorded tensors (a Linear weight's is ``G^T diag(c) A``; a convolution's is its own weight
  gradient of the scaled output gradients). A layer applied at several steps may have that matrix formed
  in one batched product instead (a convolution's as its weight gradient per sample), which then serves
  both the norm and the clipped sum. On the host the form is the one predicted fastest from the layer's
  shapes and this machine's measured rates, under a memory budget (:mod:`.cost`); off the host, the matrix
  is formed where it is no larger than its recorded tensors;
- every other module with trainable parameters of its own is a *fallback* layer (:mod:`.fallback`): the
  per-sample gradients of its own parameters are materialised from its recorded inputs and output gradients
  (``torch.func.vjp`` of that module alone; no second pass through the model). ``MultiheadAttention``
  (:mod:`.attention`) and the recurrent layers (:mod:`.recurrent`) are fallback layers with rules that know
  their layouts; in the common configuration attention runs as its parts during the recording, whose
  projections and attended values then give its per-sample gradients without computing anything twice
  (:meth:`GhostRule.recording_forward`);
- a parameter used by several modules (a tied embedding and output head) gets the sum of their parts
  (:func:`.rules.shared`): two linear maps' or two tables' as more pieces of one part, a table and a linear
  map holding one matrix as a :class:`Tied` part, whose norm adds the cross term of the two from the
  recorded tensors (``O(B T S d)``, no per-sample ``V x d`` matrix); with a materialised part among them (a
  fallback layer's, or a map's worth materialising), every module's part is materialised and summed.

Memory: every layer's recorded tensors must live until all norms are known (a clip factor depends on every
layer), so a recording holds no more than its parts need — layer outputs are not held through the backward
pass, a rule's exposed internals only as far as it reads their values (:attr:`GhostRule.internal_values`), and
a layer whose parts are all that later steps read (materialised, or without a difference form of its own)
drops its recorded calls once they are formed; a difference forms the second point's parts before it records
the first.

Norms and clip factors are computed by the native host kernels (:func:`dpvr.ops.ghost_norms`,
:func:`dpvr.ops.clip_factors`) for parameters on the host and by the same formulas in torch
(:mod:`.norms`) on other devices; both bound the norms from above including rounding.
"""

from . import attention, embedding, linear, normalization, recurrent  # noqa: F401  (they register rules)
from .clipper import ClippedSum, GhostClipper
from .fallback import VjpRule, per_sample_vjp
from .rules import Dense, GhostRule, LayerCall, Outer, Part, Rows, Tied, register_ghost_rule

__all__ = [
    "ClippedSum",
    "Dense",
    "GhostClipper",
    "GhostRule",
    "LayerCall",
    "Outer",
    "Part",
    "Rows",
    "Tied",
    "VjpRule",
    "per_sample_vjp",
    "register_ghost_rule",
]
