"""The training loss, one function for the plain step, the pipeline's last stage and
evaluation: token cross-entropy summed over the label tokens (``IGNORE_INDEX`` skipped), in
fp32. The runners scale the sum by the global token count."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from automodel.data.batches import IGNORE_INDEX


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")
