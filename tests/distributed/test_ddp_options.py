"""DDP options take effect on a real 2-rank gloo group."""

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from automodel.config.schema import DDPConfig
from automodel.distributed.ddp import apply_ddp
from automodel.distributed.init import DistInfo
from automodel.distributed.mesh import MeshAxis, build_mesh
from automodel.distributed.setup import DistributedSetup
from automodel.recipes.step import train_step
from tests.helpers import run_on_ranks


@dataclass
class _Out:  # a dataclass, like HF's ModelOutput, so DDP can find the output tensors
    logits: torch.Tensor


class BranchyLM(nn.Module):
    """A tiny LM with a branch the forward never uses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)
        self.unused = nn.Linear(8, 8)
        self.register_buffer("counter", torch.zeros(1))

    def forward(self, input_ids, position_ids=None, use_cache=False):
        return _Out(self.head(self.embed(input_ids)))


def _mesh(world):
    return build_mesh("cpu", "gloo", 1, pp=1, dp_replicate=1, dp_shard=world, cp=1, tp=1)


def _train_branchy(rank, world, find_unused):
    mesh = _mesh(world)
    opts = DDPConfig(find_unused_parameters=find_unused)
    model = apply_ddp(BranchyLM(), mesh[MeshAxis.DP], opts, torch.device("cpu"))
    setup = DistributedSetup("ddp", opts,
                             DistInfo("gloo", torch.device("cpu"), rank, world, rank), mesh)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = [(torch.randint(0, 16, (2, 5)), torch.randint(0, 16, (2, 5)))]
    try:
        losses = []
        for _ in range(3):
            losses.append(train_step(model, setup, batch, None)[0])
            optim.step()
            optim.zero_grad()
        return ("ok", losses)
    except RuntimeError as err:
        return ("error", str(err))


def test_find_unused_parameters_lets_an_unused_branch_train(tmp_path):
    results = run_on_ranks(_train_branchy, 2, True, tmp_path=tmp_path)
    assert all(kind == "ok" for kind, _ in results)
    losses = results[0][1]
    assert losses[2] < losses[0]


def test_without_find_unused_parameters_the_error_names_the_option(tmp_path):
    results = run_on_ranks(_train_branchy, 2, False, tmp_path=tmp_path)
    kinds = [kind for kind, _ in results]
    assert kinds == ["error", "error"]
    assert "parallelism.find_unused_parameters=true" in results[0][1]


def _inspect_ddp(rank, world):
    mesh = _mesh(world)
    opts = DDPConfig(bucket_cap_mb=0.5, static_graph=True, gradient_as_bucket_view=True,
                     broadcast_buffers=True)
    model = apply_ddp(BranchyLM(), mesh[MeshAxis.DP], opts, torch.device("cpu"))
    facts = {"bucket_bytes_cap": model.bucket_bytes_cap, "static_graph": model.static_graph,
             "gradient_as_bucket_view": model.gradient_as_bucket_view}
    # broadcast_buffers: rank 0's buffers overwrite the others' at every forward.
    model.module.counter.fill_(float(rank + 7))
    model(torch.zeros(1, 2, dtype=torch.long))
    facts["counter_after_forward"] = float(model.module.counter)
    plain = apply_ddp(BranchyLM(), mesh[MeshAxis.DP], DDPConfig(), torch.device("cpu"))
    plain.module.counter.fill_(float(rank + 7))
    plain(torch.zeros(1, 2, dtype=torch.long))
    facts["plain_counter_after_forward"] = float(plain.module.counter)
    facts["plain_bucket_bytes_cap"] = plain.bucket_bytes_cap
    return facts


def test_ddp_knobs_reach_distributed_data_parallel(tmp_path):
    facts = run_on_ranks(_inspect_ddp, 2, tmp_path=tmp_path)
    for rank, f in enumerate(facts):
        assert f["bucket_bytes_cap"] == int(0.5 * 1024 * 1024)
        assert f["plain_bucket_bytes_cap"] == 25 * 1024 * 1024  # PyTorch's default
        assert f["static_graph"] is True and f["gradient_as_bucket_view"] is True
        assert f["counter_after_forward"] == 7.0  # synced from rank 0
        assert f["plain_counter_after_forward"] == float(rank + 7)  # default: not synced


if __name__ == "__main__":
    pytest.main([__file__])
