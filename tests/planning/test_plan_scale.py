"""The planner's cost at scale (issue 27, "Scale"). The figures themselves are measured by
benchmarks/plan_scale.py (tests never assert time)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.fast
def test_ops_on_meta_tensors_only_run_on_meta_kernels():
    """Under the planner's fake mode, an op whose inputs are all plain meta tensors (the meta
    model's parameters, split and sharded by ``parallelize`` before they are materialized)
    runs on torch's meta kernels: plain meta outputs, not a FakeTensor per output (FSDP2
    makes one piece per dp_shard rank of every parameter). Ops on fake tensors stay fake;
    host-only ops stay real."""
    from automodel.compat.planning import fake_tensor_mode, is_fake
    from automodel.planning.fake import RealStaysReal

    weight = torch.empty(256, 64, device="meta")
    host = torch.arange(6)
    with fake_tensor_mode() as mode, RealStaysReal():
        pieces = torch.chunk(weight, 256, dim=0)
        fake = torch.empty(4, 64)  # (a factory op: fake)
        halves = torch.chunk(fake, 2)  # (a fake input: fake outputs)
        nonzero = torch.nonzero(host > 2)
    assert len(pieces) == 256
    assert all(p.device.type == "meta" and not is_fake(p) for p in pieces)
    assert pieces[0].shape == (1, 64)
    assert is_fake(fake) and all(is_fake(h) for h in halves) and fake.fake_mode is mode
    assert not is_fake(nonzero) and nonzero.flatten().tolist() == [3, 4, 5]
