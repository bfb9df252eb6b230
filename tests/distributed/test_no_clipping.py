"""Parity without gradient clipping (``optim.max_grad_norm=null``).

Every other parity run clips at the default ``max_grad_norm=1.0``, and their gradient norms
are above 1 at every step (3.5, 7.6, 4.1, 2.2, 1.7 in the single-process reference), so each
step's update uses ``g / |g|``: a gradient off by any factor at some step leaves the losses
unchanged, and only the logged gradient norm can show it. Without clipping, a gradient whose
scale is wrong at some steps and not at others (AdamW is invariant to one constant factor
only) moves the losses themselves.
"""

import numpy as np

from tests.distributed.test_parity import assert_matches
from tests.helpers import FP32, train

NO_CLIP = "optim.max_grad_norm=null"


def test_fsdp2_accumulation_without_clipping_matches_single_process(reference, tmp_path):
    ref = reference(NO_CLIP)
    # FSDP2, 2 ranks, 2 micro-batches per rank (deferred gradient reduce), fp32
    records = train(["parallelism=fsdp2", FP32, "trainer.local_batch_size=2", NO_CLIP], tmp_path)
    assert_matches(records, ref)
    # The option really turned clipping off: the same first step as the clipped reference (same
    # weights and batch, a norm far above max_grad_norm=1.0), then other losses (AdamW's first
    # update is g/|g| elementwise whatever the clipping; from the second the unclipped first
    # gradient weighs 3.5x more in its moments)
    clipped = reference()
    assert ref[0]["loss"] == clipped[0]["loss"] and ref[0]["grad_norm"] == clipped[0]["grad_norm"]
    assert ref[0]["grad_norm"] > 2.0
    loss, clipped_loss = np.array([r["loss"] for r in ref]), np.array([r["loss"] for r in clipped])
    assert np.all(np.abs(loss[2:] / clipped_loss[2:] - 1) > 1e-3), (loss, clipped_loss)
