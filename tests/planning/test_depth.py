"""A deep model of alike layers planned from two shallow copies: every number equals the
simulation of the whole model."""

import pytest

from automodel.planning.depth import extend


@pytest.mark.fast
def test_extend_follows_the_line_through_two_depths():
    a = {"rank": 3, "stages": [0, 2], "peak_bytes": 100, "flops": 10.0,
         "comm": {"tp": {"all_reduce": 40}}, "memory": {"activations": 60}}
    b = {"rank": 3, "stages": [0, 2], "peak_bytes": 130, "flops": 14.0,
         "comm": {"tp": {"all_reduce": 50}, "pp": {"send": 8}}, "memory": {"activations": 80}}
    out = extend(a, b, 4, 6, 20)  # 2 stages of 2, then of 3 layers; 10 per stage really
    assert out["rank"] == 3 and out["stages"] == [0, 2]
    assert out["peak_bytes"] == 100 + 15 * 16 and out["flops"] == pytest.approx(10 + 2 * 16)
    assert out["comm"] == {"tp": {"all_reduce": 40 + 5 * 16}, "pp": {"send": 8 * 8}}
    assert out["memory"] == {"activations": 60 + 10 * 16}


def _shallow_equals_full(overrides: list[str], depths) -> None:
    from automodel.plan_cli import load_plan
    from automodel.planning.depth import shallow_depths
    from automodel.planning.plan import rank_classes, simulate_classes

    cfg, _ = load_plan(overrides)
    assert shallow_depths(cfg) == depths
    classes = rank_classes(cfg)
    shallow = simulate_classes(cfg, classes, 2)
    full = simulate_classes(cfg, classes, 2, full_depth=True)
    for s, f in zip(shallow, full):
        for key in ("peak_bytes", "memory", "flops", "comm", "comm_calls"):
            assert s[key] == f[key], key


def test_two_shallow_simulations_give_the_full_ones_numbers():
    """llama_tiny with 24 layers over 2 pipeline stages (12 each), FSDP2 x TP, selective AC."""
    _shallow_equals_full(["model.config.num_hidden_layers=24", "parallelism=fsdp2",
                          "mesh.dp_size=2", "mesh.tp_size=2", "mesh.pp_size=2", "pipeline=1f1b",
                          "parallelism.activation_checkpointing=selective",
                          "trainer.global_batch_size=8"], (2, [12, 12], (1, 2)))


def test_shallow_depths_are_past_fsdps_buffers_in_flight():
    """Small shards (64 FSDP ranks), two sequences per micro-batch, full AC, TP 2 + SP: the
    peak is in the backward, where FSDP2 holds a few layers' buffers at once (a prefetched
    layer, a reduction in flight). From 2 and 3 layers the line climbed a whole unsharded
    layer per layer; from 4 and 5 it is exact."""
    _shallow_equals_full(["model.config.num_hidden_layers=12", "parallelism=fsdp2",
                          "mesh.dp_size=64", "mesh.tp_size=2", "pipeline=none",
                          "parallelism.sequence_parallel=true",
                          "parallelism.activation_checkpointing=full",
                          "trainer.local_batch_size=2", "trainer.global_batch_size=128"],
                         (1, [12], (4, 5)))


def test_a_pipeline_keeping_its_layers_gathered_is_cut_to_one_and_two_layers():
    """Under a pipeline FSDP2 keeps every layer gathered all step: from 1 and 2 layers per
    stage the line is exact (interleaved, 4 stages of 8 layers, TP 2 + SP, two sequences per
    micro-batch, full AC, small shards); with reshard_after_forward=true the job keeps the
    pair of 4 and 5."""
    from automodel.plan_cli import load_plan
    from automodel.planning.depth import shallow_depths

    _shallow_equals_full(["model.config.num_hidden_layers=32", "parallelism=fsdp2",
                          "mesh.dp_size=64", "mesh.tp_size=2", "mesh.pp_size=2",
                          "pipeline=interleaved", "parallelism.sequence_parallel=true",
                          "parallelism.activation_checkpointing=full",
                          "trainer.local_batch_size=2", "trainer.global_batch_size=256"],
                         (4, [8, 8, 8, 8], (1, 2)))
    cfg, _ = load_plan(["model.config.num_hidden_layers=32", "parallelism=fsdp2",
                        "mesh.dp_size=2", "mesh.pp_size=2", "pipeline=1f1b",
                        "parallelism.reshard_after_forward=true"])
    assert shallow_depths(cfg) == (2, [16, 16], (4, 5))
