"""The LM head joins the loss (``trainer.loss``): the model part returns its hidden states
and ``automodel.loss.HeadLoss`` runs the head's matmul and the cross-entropy together, chunk
by chunk, so the ``[tokens, vocab]`` logits never exist whole.

It is exact only where the model's logits are the head's output and nothing more: a
``nn.Linear`` head (bias allowed) and no soft-capping or scaling of the logits after it.
``auto`` takes it there and the plain loss elsewhere; ``fused`` on a model that does more
is refused, naming what.

The head module stays in place under its own name (checkpoints, exports and tied
embeddings are unchanged); only its ``forward`` passes its input through. Under tensor
parallelism ``apply_tp`` splits its weight over the vocabulary without gathering its output
(``vocab_parallel_head``). Under DDP the head's forward also shows DDP that the head's
parameters were used (``_UsesHead``): the loss applies them after the wrapped forward.
"""

from __future__ import annotations

import logging
import types

import torch
from torch import nn

from automodel.loss import HeadLoss

log = logging.getLogger(__name__)

# Config keys of transformations some families apply to the logits after the head.
_LOGIT_CHANGES = {"final_logit_softcapping": "soft-caps its logits",
                  "logit_scale": "scales its logits", "logits_scaling": "scales its logits"}


def fused_head_problem(model: nn.Module) -> str | None:
    """Why the fused head loss would not equal the model's own logits' loss (None: it
    would)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        return f"its LM head is {type(head).__name__}, not a linear layer"
    extra = sorted(n for n, _ in head.named_parameters() if n not in ("weight", "bias"))
    if extra or type(head).forward is not nn.Linear.forward:  # (Dory's scaled head)
        return (f"its LM head {type(head).__name__} does more than a linear layer (its own "
                f"forward{', weights ' + ', '.join(extra) if extra else ''})")
    configs = [model.config]
    if hasattr(model.config, "get_text_config"):
        configs.append(model.config.get_text_config())
    for cfg in configs:
        for key, what in _LOGIT_CHANGES.items():
            value = getattr(cfg, key, None)
            if value not in (None, 1, 1.0):
                return f"it {what} ({key}={value})"
    return None


def _pass_through(hidden_states):
    return hidden_states


class _UsesHead(torch.autograd.Function):
    """The identity on the hidden states, whose graph node also takes the head's parameters
    (their gradients come from the loss, not from here): DDP with ``find_unused_parameters``
    finds the parameters a forward used by walking the graph from the wrapped module's outputs,
    and would otherwise take the head, used only by the loss outside that forward, for unused,
    mark it ready at once, and fail when its gradient arrives."""

    @staticmethod
    def forward(ctx, hidden_states, *params):
        ctx.num_params = len(params)
        return hidden_states.view_as(hidden_states)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *([None] * ctx.num_params))


def _pass_through_using_head(head: nn.Module, hidden_states):
    # (the head's parameters at the call: materializing the model replaces them)
    return _UsesHead.apply(hidden_states, *(p for p in head.parameters() if p.requires_grad))


def head_fqn(model: nn.Module) -> str | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return next((name for name, m in model.named_modules() if m is head), None)


def apply_fused_head(part: nn.Module, mode: str, chunk: int, has_head: bool = True,
                     custom_loss: bool = False, show_use: bool = False) -> HeadLoss | None:
    """``trainer.loss`` on one model part: detach its head and return the loss that applies
    it, or None for the plain loss. ``has_head``: the part holds the LM head (a pipeline's
    last stage, or the whole model); ``custom_loss``: a ``pipeline.loss_fn`` wants logits;
    ``show_use``: the part's outputs show that the head's parameters were used (DDP, whose
    ``find_unused_parameters`` looks for them there: ``_UsesHead``)."""
    if mode == "plain" or not has_head or custom_loss:
        return None
    problem = fused_head_problem(part)
    if problem is not None:
        if mode == "fused":
            raise ValueError(f"trainer.loss=fused: {type(part).__name__} cannot fuse its head "
                             f"with the loss: {problem}; use trainer.loss=auto or plain")
        log.info("trainer.loss=auto: the plain loss, since %s", problem)
        return None
    head = part.get_output_embeddings()
    # the part's "logits" are now its hidden states
    head.forward = (types.MethodType(_pass_through_using_head, head) if show_use
                    else _pass_through)
    log.info("trainer.loss=%s: the LM head runs with the loss, %d tokens at a time", mode, chunk)
    return HeadLoss(head, chunk)
