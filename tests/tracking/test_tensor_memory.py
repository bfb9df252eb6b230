"""``peak_tensor_bytes`` (issue 27): each rank's peak of live tensor bytes, counted on the CPU
by ``LiveTensorBytes`` in real mode; checked against a hand count and torch's ``MemTracker``
(in real mode), and logged per rank by a real pipeline run, whose measured communication
(``planning/measured.py``) is checked by hand too."""

import math

import pytest
import torch
from torch import nn

from automodel.api import load_config
from automodel.config.build import ConfigError
from automodel.planning.measured import comm_bytes_from_trace
from automodel.tracking.memory import LiveTensorBytes
from tests.helpers import FP32, train


def _memtracker_peak(step, *roots) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*roots)
    with tracker:
        step()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


@pytest.mark.fast  # one process, no process group
def test_a_linear_stack_counts_by_hand_and_peaks_as_memtracker():
    torch.manual_seed(0)
    width, batch, depth = 128, 16, 3
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(depth)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(batch, width)
    weights, act = depth * width * width * 4, batch * width * 4

    def step(checks=None):
        loss = model(x).square().sum()
        if checks is not None:  # saved for backward: each layer's input after x, the output
            checks.append(tracker.current - base - ((depth - 1) * act + act + 4))
        loss.backward()
        if checks is not None:  # the gradients and the loss
            checks.append(tracker.current - base - (weights + 4))
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # Adam's states exist from here on
    unrelated = torch.empty(1000)  # (host data, as a dataset's rows: not the model's)
    tracker = LiveTensorBytes().start([model], [opt])
    tracker.note(x)  # (the step's input, as the runner notes each step's batches)
    # parameters, Adam's two states and its step counters (fp32 scalars), the input
    base = tracker.current
    assert base == 3 * weights + depth * 4 + act and unrelated.numel()
    checks = []
    with tracker:
        step(checks)
    assert checks == [0, 0] and tracker.current == base
    mine = tracker.peak
    assert mine == _memtracker_peak(step, model, opt, x)
    # a storage resized in place (as FSDP2 frees and refills its parameters) is followed
    with tracker:
        held = torch.empty(0)
        held.untyped_storage().resize_(4096)
        assert tracker.current == base + 4096
        held.untyped_storage().resize_(0)
        assert tracker.current == base


@pytest.mark.fast  # one process, no process group
def test_llama_tiny_step_peaks_within_two_percent_of_memtracker():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (4, 32))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    tracker = LiveTensorBytes().start([model], [opt])
    tracker.note(ids)
    with tracker:
        step()
    assert tracker.peak == pytest.approx(_memtracker_peak(step, model, opt, ids), rel=0.02)


@pytest.mark.fast
def test_the_cpu_count_with_compile_is_refused_naming_both_keys():
    with pytest.raises(ConfigError, match=r"trainer.track_tensor_memory=true with "
                                          r"parallelism.enable_compile=true"):
        load_config(["parallelism=fsdp2", "parallelism.enable_compile=true",
                     "trainer.track_tensor_memory=true"], env={})


def test_pipeline_ranks_log_their_own_peaks_and_send_what_was_counted(tmp_path):
    """PP 2 (1F1B, 8 micro-batches of 1 x 32 tokens, hidden 64, fp32): each stage has its
    own peak; each rank sends and receives one activation per micro-batch on ``pp``."""
    records = train(["parallelism=fsdp2", FP32, "mesh.pp_size=2", "pipeline=1f1b",
                     "trainer.track_tensor_memory=true", "trainer.profile_steps=[3,4]"],
                    tmp_path)
    by_rank = [r["peak_tensor_bytes_by_rank"] for r in records]
    assert all(len(b) == 2 and r["peak_tensor_bytes"] == max(b)
               for r, b in zip(records, by_rank))
    assert by_rank[1] == by_rank[2] == by_rank[4] != by_rank[0]  # (Adam's states from step 2)
    assert by_rank[1][0] != by_rank[1][1]  # two different stages
    # llama_tiny: the whole model's parameters in fp32, the stage's at least a quarter
    params = 256 * 64 * 2 + 64 + 4 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 176 + 2 * 64)
    assert all(4 * 4 * params // 4 < b < 4 * 4 * params for b in by_rank[1])
    activation = 1 * 32 * 64 * 4
    for rank in (0, 1):
        comm = comm_bytes_from_trace(str(tmp_path / "profile" / f"trace_rank{rank}.json"))
        assert comm["pp"]["send"] == comm["pp"]["recv"] == 8 * activation
        assert math.isclose(sum(comm["pp"].values()), 16 * activation, rel_tol=0.01)
