"""``trainer.profile_steps``: where a step's time goes, written per rank."""

import json

from automodel.planning.measured import comm_bytes_from_trace
from tests.helpers import train


def test_profiled_steps_write_traces_and_a_breakdown(tmp_path):
    train(["parallelism=fsdp2", "mesh.dp_size=2", "trainer.profile_steps=[2,3]"], tmp_path)
    # the communication measured from the trace (planning/measured.py): llama_tiny's
    # parameters, gathered in bf16 (parallelism.mp_policy's default) for the forward and
    # again for the backward but the last block's (kept gathered), reduce-scattered in fp32
    block = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 176 + 2 * 64
    params = 256 * 64 * 2 + 64 + 4 * block
    for rank in (0, 1):
        comm = comm_bytes_from_trace(str(tmp_path / "profile" / f"trace_rank{rank}.json"))
        fsdp = comm["dp_shard_cp"]
        assert fsdp["all_gather"] == 2 * (params + 3 * block)
        assert fsdp["reduce_scatter"] == 4 * params
    for rank in (0, 1):
        assert (tmp_path / "profile" / f"trace_rank{rank}.json").stat().st_size > 0
        table = json.loads((tmp_path / "profile" / f"breakdown_rank{rank}.json").read_text())
        assert table["steps"] == [2, 3]
        seconds = table["seconds_per_step"]
        phases = ("forward", "loss", "backward", "clip", "optimizer")
        assert all(seconds[p] > 0 for p in phases)
        # FSDP2 on 2 ranks communicates inside the phases; the phases fit in the step
        assert 0 < seconds["collectives (inside the phases)"] < seconds["step"]
        assert sum(seconds[p] for p in phases) <= seconds["step"] * 1.001
