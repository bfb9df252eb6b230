"""pipeline.pp_recv_buffer_pool with interleaved 1F1B: receive buffers pooled from the
lifetimes in torch's lowered schedule (issue 23, item 11)."""

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

from automodel.distributed.pipelining.buffer_pool import lifetime_owners, receive_lifetimes
from tests.distributed.test_parity import assert_same_steps
from tests.helpers import FP32, train

# pp=2, 4 stages (two per rank), 8 micro-batches. Read off torch's lowered schedule
# (pipeline_order_with_comms): e.g. on rank 1, 1RECV_F3 is posted before 1F2 reads
# micro-batch 2, so stage 1 needs two activation sets; on rank 0, 2RECV_B(k+1) always comes
# after 2B(k), so stage 2 needs one gradient set. {stage: (activation sets, gradient sets)}
SETS = {0: (0, 1), 1: (2, 2), 2: (2, 1), 3: (2, 0)}
MICROBATCHES = 8


def _lowered(rank: int, pp: int = 2, num_stages: int = 4):
    # the schedule needs only these attributes of its stages to lower itself
    stages = [SimpleNamespace(group_size=pp, group_rank=rank, num_stages=num_stages,
                              stage_index=s) for s in range(rank, num_stages, pp)]
    return ScheduleInterleaved1F1B(stages, MICROBATCHES).pipeline_order_with_comms[rank]


@pytest.mark.fast
def test_lifetimes_of_the_lowered_schedule_give_the_fewest_safe_buffer_sets():
    for rank in (0, 1):
        actions = _lowered(rank)
        for stage in range(rank, 4, 2):
            owners = lifetime_owners(actions, stage)
            assert tuple(len(set(o.values())) for o in owners) == SETS[stage]
            for recv, owner in zip((_ComputationType.RECV_F, _ComputationType.RECV_B), owners):
                life = receive_lifetimes(actions, stage, recv)
                assert set(life) == set(owner)  # every received micro-batch is pooled
                # safe: micro-batches that share a set are never alive at once
                for a in life:
                    for b in life:
                        if a < b and owner[a] == owner[b]:
                            assert life[a][1] < life[b][0] or life[b][1] < life[a][0]
                # fewest: as many sets as receives ever alive at the same action
                alive = max(sum(s <= t <= e for s, e in life.values())
                            for t in range(len(actions))) if life else 0
                assert len(set(owner.values())) == alive


def test_interleaved_recv_buffer_pool_gives_identical_losses_and_predicted_memory(tmp_path):
    # 8 sequences per step: 8 micro-batches. Evaluation after each step runs the schedule
    # forward-only, which sets the receive buffers up again: the pool must survive that.
    base = ["parallelism=fsdp2", FP32, "pipeline=interleaved", "pipeline.pp_microbatch_size=1",
            "trainer.max_steps=3", "data.eval_fraction=0.1", "trainer.eval_every=1",
            "trainer.eval_batches=1"]
    plain = train(base, tmp_path / "plain")
    pooled = train(base + ["pipeline.pp_recv_buffer_pool=true"], tmp_path / "pooled")
    assert_same_steps(pooled, plain, steps=(1, 2, 3))
    for key in ("loss", "grad_norm", "eval_loss"):  # bit for bit
        assert [r[key] for r in pooled] == [r[key] for r in plain], key
    # every set is one hidden state: 1 sequence x 32 tokens x 64 (llama_tiny) x fp32
    set_bytes = 1 * 32 * 64 * 4
    received = sum(1 for a, g in SETS.values() for n in (a, g) if n)  # stage-directions
    assert plain[-1]["pp_recv_buffer_bytes"] == received * MICROBATCHES * set_bytes
    assert pooled[-1]["pp_recv_buffer_bytes"] == sum(map(sum, SETS.values())) * set_bytes
