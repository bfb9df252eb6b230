"""Pipelines with tensor and sequence parallelism (PP2 x TP2 on 4 ranks): each TP rank sends
its local sequence shard to the same TP rank of the next stage. Losses and grad norms match
a single process (fp32), and the receive buffers hold [micro-batch, seq / tp, hidden]; once
with the decoder layers compiled."""

import pytest

from tests.distributed.test_parity import assert_close_to_fp32, assert_matches
from tests.helpers import FP32, TRAINER, train

PP_TP_SP = ["parallelism=fsdp2", FP32, "mesh.tp_size=2", "parallelism.sequence_parallel=true",
            "pipeline.pp_microbatch_size=2"]
HIDDEN = 64  # llama_tiny's hidden_size


def _local_boundary_bytes(stages: int) -> int:
    """Receive-buffer bytes summed over the pipeline ranks of one TP rank: every stage but the
    first receives activations, every one but the last gradients, one buffer per micro-batch,
    each of a micro-batch's local sequence shard in fp32."""
    seq_len = int(next(o for o in TRAINER if o.startswith("trainer.seq_len=")).split("=")[1])
    micro_batches, micro_batch, tp = 8 // 2, 2, 2
    return 2 * (stages - 1) * micro_batches * micro_batch * (seq_len // tp) * HIDDEN * 4


@pytest.mark.parametrize("name,overrides,stages", [
    # 1F1B with static stage shapes: the examples give stages the local length seq / tp
    ("1f1b_static_shapes", ["pipeline=1f1b", "pipeline.pp_seq_len=32"], 2),
    # interleaved: two stages per rank (one layer each), shapes inferred at run time, the
    # layers compiled (compile with TP switches sequence parallelism on by itself: test_resolve)
    ("interleaved_compiled", ["pipeline=interleaved", "parallelism.enable_compile=true"], 4),
])
def test_pp2_tp2_sequence_parallel_matches_single_process(name, overrides, stages, reference,
                                                          tmp_path):
    records = train(PP_TP_SP + overrides, tmp_path)
    assert_matches(records, reference())
    # what crossed the stage boundaries: each TP rank's half of the sequence (the whole
    # sequence would be twice as many bytes)
    assert records[-1]["pp_recv_buffer_bytes"] == _local_boundary_bytes(stages)



def test_pp2_tp2_sequence_parallel_under_the_default_mp_policy(reference, tmp_path):
    # what users run: bf16 parameters (the default mp_policy), close to the fp32 reference;
    # with gradient accumulation (two schedule steps per optimizer step)
    records = train([o for o in PP_TP_SP if o != FP32]
                    + ["pipeline=1f1b", "trainer.local_batch_size=4"], tmp_path)
    assert_close_to_fp32(records, reference(), loss_rtol=1e-2)
