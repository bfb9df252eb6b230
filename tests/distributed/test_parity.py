"""Loss parity: every data-parallel layout matches a single-process run (fp32, rtol 1e-5)."""

import numpy as np
import pytest

from tests.helpers import FP32, train


def assert_matches(records, ref, rtol=1e-5, grad_rtol=1e-4):
    losses = [r["loss"] for r in records]
    ref_losses = [r["loss"] for r in ref]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert ref_losses[0] - ref_losses[-1] > 0.3, "the reference must learn, or parity means little"
    np.testing.assert_allclose(losses, ref_losses, rtol=rtol)
    np.testing.assert_allclose([r["grad_norm"] for r in records],
                               [r["grad_norm"] for r in ref], rtol=grad_rtol)


def test_reference_accumulation_matches_one_big_batch(reference, tmp_path):
    # Sanity of the reference itself: micro-batching does not change the loss.
    assert_matches(train(["parallelism=none", "trainer.local_batch_size=2"], tmp_path),
                   reference())


@pytest.mark.parametrize("name,overrides", [
    ("ddp", ["parallelism=ddp"]),
    ("ddp_accum", ["parallelism=ddp", "trainer.local_batch_size=2"]),
    ("ddp_selective_ac", ["parallelism=ddp", "parallelism.activation_checkpointing=selective",
                          "parallelism.bucket_cap_mb=0.01", "parallelism.static_graph=true",
                          "parallelism.gradient_as_bucket_view=true"]),
    ("fsdp2", ["parallelism=fsdp2", FP32]),
    ("fsdp2_accum_deferred", ["parallelism=fsdp2", FP32, "trainer.local_batch_size=2"]),
    ("fsdp2_accum_not_deferred", ["parallelism=fsdp2", FP32, "trainer.local_batch_size=1",
                                  "parallelism.defer_fsdp_grad_sync=false"]),
    ("fsdp2_full_ac", ["parallelism=fsdp2", FP32, "parallelism.activation_checkpointing=full"]),
    ("fsdp2_selective_ac_language", ["parallelism=fsdp2", FP32,
                                     "parallelism.activation_checkpointing=selective",
                                     "parallelism.activation_checkpointing_scope=[language]"]),
    ("fsdp2_no_prefetch_reshard", ["parallelism=fsdp2", FP32,
                                   "parallelism.enable_fsdp2_prefetch=false",
                                   "parallelism.reshard_after_forward=true"]),
    ("fsdp2_deep_prefetch_no_reshard", ["parallelism=fsdp2", FP32,
                                        "parallelism.fsdp2_forward_prefetch_depth=2",
                                        "parallelism.fsdp2_backward_prefetch_depth=3",
                                        "parallelism.reshard_after_forward=false"]),
    ("fsdp2_cpu_offload", ["parallelism=fsdp2", FP32, "parallelism.offload_policy="
                           "{_target_:torch.distributed.fsdp.CPUOffloadPolicy}"]),
    ("fsdp2_patched_packed_check", ["parallelism=fsdp2", FP32,
                                    "parallelism.patch_is_packed_sequence=true"]),
])
def test_two_ranks_match_single_process(name, overrides, reference, tmp_path):
    assert_matches(train(overrides, tmp_path), reference())


def test_hsdp_2x2_matches_single_process(reference, tmp_path):
    records = train(["parallelism=hsdp", FP32, "trainer.local_batch_size=1"], tmp_path)
    assert_matches(records, reference())


def test_fsdp2_bf16_default_mp_policy_close_to_fp32(reference, tmp_path):
    records = train(["parallelism=fsdp2"], tmp_path)  # null mp_policy = bf16 params
    losses = np.array([r["loss"] for r in records])
    ref = np.array([r["loss"] for r in reference()])
    np.testing.assert_allclose(losses, ref, rtol=2e-2)
    assert not np.allclose(losses, ref, rtol=1e-6), "bf16 compute must differ from fp32 a little"


def test_autocast_bf16_close_to_fp32(reference, tmp_path):
    records = train(["parallelism=ddp", "parallelism.autocast_dtype=bfloat16"], tmp_path)
    losses = np.array([r["loss"] for r in records])
    ref = np.array([r["loss"] for r in reference()])
    np.testing.assert_allclose(losses, ref, rtol=2e-2)
    assert not np.allclose(losses, ref, rtol=1e-6), "autocast must actually run in bf16"


def test_per_layer_compile_matches(reference, tmp_path):
    # Slow (inductor compiles a decoder layer on each rank); one test is enough.
    records = train(["parallelism=fsdp2", FP32, "parallelism.enable_compile=true",
                     "parallelism.activation_checkpointing=full"], tmp_path)
    assert_matches(records, reference())
