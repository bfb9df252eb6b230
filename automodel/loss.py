"""The training loss, one definition for the plain step, the pipeline's last stage and
evaluation: token cross-entropy summed over the label tokens (``IGNORE_INDEX`` skipped), in
fp32. The runners scale the sum by the global token count.

Two ways to compute it:

- ``summed_cross_entropy(logits, labels)``: from the model's logits, which the LM head has
  made for every token (``[tokens, vocab]``, then an fp32 copy of it);
- ``HeadLoss`` (``trainer.loss``: ``fused``, the default where it is exact): the model stops
  before its LM head and the head's matmul and the cross-entropy run together over chunks of
  ``trainer.loss_chunk_tokens`` tokens (``LinearCrossEntropy``). The gradients of the chunk
  are computed right there, so no ``[tokens, vocab]`` tensor outlives its chunk, in forward
  or backward, and no matmul is repeated. Under tensor parallelism the head stays split over
  the vocabulary and the softmax is reduced across the ranks (three small all-reduces per
  chunk): the vocabulary is never gathered.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from automodel.data.batches import IGNORE_INDEX


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


class LinearCrossEntropy(torch.autograd.Function):
    """sum over tokens of cross_entropy(hidden @ weight.T + bias, labels), chunk by chunk.

    ``weight`` [V_local, H] is this rank's vocabulary rows ``vocab_start ..`` (all of them
    without ``group``). The forward computes the loss and, when gradients are wanted, the
    gradients of ``hidden``, ``weight`` and ``bias``; backward scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk: int, vocab_start: int, group,
                want_grad: bool):
        rows = weight.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_grad else None
        grad_bias = (torch.zeros_like(bias, dtype=torch.float32)
                     if want_grad and bias is not None else None)
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start:start + chunk]
            y = labels[start:start + chunk]
            logits = F.linear(h, weight, bias).float()  # [c, V_local], as the head would
            valid = y != IGNORE_INDEX
            local = y - vocab_start
            mine = valid & (local >= 0) & (local < rows)
            index = torch.where(mine, local, torch.zeros_like(local)).unsqueeze(1)
            target = torch.where(mine, logits.gather(1, index).squeeze(1),
                                 torch.zeros((), dtype=logits.dtype, device=logits.device))
            target = _all_reduce(target, dist.ReduceOp.SUM, group)
            top = _all_reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX, group)
            exp = logits.sub_(top.unsqueeze(1)).exp_()  # (in place: one [c, V] buffer)
            sum_exp = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, group)
            total += torch.where(valid, torch.log(sum_exp) + top - target,
                                 torch.zeros_like(top)).sum()
            if not want_grad:
                continue
            # d loss / d logits = softmax - one-hot on the label tokens, 0 on ignored ones
            # (no host read: masks multiply and scatter)
            grad_logits = exp.mul_((valid / sum_exp).unsqueeze(1))
            grad_logits.scatter_add_(1, index, -mine.to(grad_logits.dtype).unsqueeze(1))
            g = grad_logits.to(weight.dtype)
            torch.matmul(g, weight, out=grad_hidden[start:start + chunk])
            if grad_weight.dtype == g.dtype:
                grad_weight.addmm_(g.t(), h)
            else:
                grad_weight += (g.t() @ h).float()
            if grad_bias is not None:
                grad_bias += grad_logits.sum(dim=0)
        if want_grad:
            # each rank's rows contribute part of every token's hidden-state gradient
            _all_reduce(grad_hidden, dist.ReduceOp.SUM, group)
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype),
                                  None if grad_bias is None else grad_bias.to(bias.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        scale = grad_output.to(grad_hidden.dtype)
        return (grad_hidden * scale, grad_weight * scale.to(grad_weight.dtype),
                None if grad_bias is None else grad_bias * scale.to(grad_bias.dtype),
                None, None, None, None, None)


def linear_cross_entropy(hidden, weight, bias, labels, chunk: int, vocab_start: int = 0,
                         group=None) -> torch.Tensor:
    """``LinearCrossEntropy`` over ``hidden`` [..., H] and ``labels`` [...]."""
    # hidden states in another dtype than the head's weight (Falcon-Mamba keeps its residual
    # stream in float32 under bfloat16 weights): cast as the models' own heads do
    hidden = hidden.to(weight.dtype)
    want_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))
    return LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias,
                                    labels.reshape(-1), chunk, vocab_start, group, want_grad)


class HeadLoss:
    """The loss of a model part whose LM head ``head`` was detached (``distributed/
    fused_head.py``): the part returns hidden states, this applies the head and the
    cross-entropy together. A head split over the vocabulary by tensor parallelism (a
    ``Shard(0)`` DTensor weight) keeps its split; a sequence-parallel hidden state is
    gathered first."""

    def __init__(self, head, chunk: int):
        self.head, self.chunk = head, chunk

    def __call__(self, hidden, labels) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        weight, bias = self.head.weight, getattr(self.head, "bias", None)
        vocab_start, group = 0, None
        if isinstance(weight, DTensor):
            mesh, placement = weight.device_mesh, weight.placements[0]
            if placement == Shard(0):
                group = mesh.get_group()
                vocab_start = mesh.get_local_rank() * weight.to_local().shape[0]
            weight = weight.to_local()
            bias = bias.to_local() if isinstance(bias, DTensor) else bias
        if isinstance(hidden, DTensor):  # sequence parallel: every rank needs every token
            hidden = hidden.redistribute(
                placements=[Replicate()] * hidden.device_mesh.ndim).to_local()
        return linear_cross_entropy(hidden, weight, bias, labels, self.chunk, vocab_start,
                                    group)
