"""A pipeline of many micro-batches planned from two short runs of its schedule
(automodel/planning/microbatches.py) equals the whole schedule's (and every layer's)
simulation: every number of every rank class (peak, memory parts, FLOPs, bytes and calls per
axis), on 1F1B with tp, interleaved with full AC (both cut in depth too: four short runs a
class, the fourth corner made of them) and an image-text model under 1F1B, at counts where the
short runs cost less than the whole schedule."""

from __future__ import annotations

import pytest

from automodel.api import load_config
from automodel.planning.microbatches import microbatch_pair

PP2 = ["distributed.nproc_per_node=2", "mesh.pp_size=2", "data=synthetic",
       "trainer.global_batch_size=10"]
# (cut to 1 and 2 layers a stage from 4 layers a stage here, where the planner waits for 8:
# the line is the same, and the whole model's simulation to compare with half as long)
SHALLOW_FROM = 4
LAYOUTS = {
    # 4 layers a stage over tp 2, 1F1B: cut to 1 and 2 layers a stage too (four short runs)
    "deep_1f1b_tp2": ["distributed.nproc_per_node=4", "mesh.pp_size=2", "mesh.tp_size=2",
                      "pipeline=1f1b", "model.config.num_hidden_layers=8", "data=synthetic",
                      "trainer.global_batch_size=12"],
    # interleaved (two stages a rank: 3 pp and 4 pp micro-batches), full AC, cut as well
    "deep_interleaved_ac": [*PP2[:3], "pipeline=interleaved", "trainer.global_batch_size=14",
                            "model.config.num_hidden_layers=16",
                            "parallelism.activation_checkpointing=full"],
    # an image-text model (never cut): its image batches along the line too
    "image_text_1f1b": [*PP2[:3], "trainer.global_batch_size=16", "pipeline=1f1b",
                        "model=llava_tiny", "data.image_every=2"],
}


def numbers(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(numbers(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[prefix + k] = v
    return out


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_two_short_schedules_extend_to_the_whole_one(name, monkeypatch):
    from automodel.planning import depth
    from automodel.planning.plan import planned_runs, rank_classes, simulate_classes

    monkeypatch.setattr(depth, "MIN_LAYERS_GATHERED", SHALLOW_FROM)
    cfg = load_config(LAYOUTS[name], env={"CUDA_VISIBLE_DEVICES": ""})
    assert (depth.shallow_depths(cfg) is None) == ("image_text" in name)  # (cut: the deep)
    pp, v = cfg.layout.pp, 2 if "interleaved" in name else 1
    n = cfg.trainer.global_batch_size // cfg.layout.dp
    assert planned_runs(cfg)[0] == ((v + 1) * pp, (v + 2) * pp, n)  # (taken)
    classes = rank_classes(cfg)
    short = simulate_classes(cfg, classes)
    whole = simulate_classes(cfg, classes, full_depth=True)  # (every micro-batch, layer)
    for s, w, c in zip(short, whole, classes):
        a, b = numbers(s), numbers(w)
        assert a == b, (c.name, {k: (a.get(k), b.get(k)) for k in {*a, *b}
                                 if a.get(k) != b.get(k)})


@pytest.mark.fast
def test_the_shortcut_is_taken_only_where_the_steady_state_is_known():
    def pair(*overrides):
        return microbatch_pair(load_config([*PP2, *overrides], env={"CUDA_VISIBLE_DEVICES": ""}))

    assert pair("pipeline=1f1b") == (4, 6, 10)
    assert pair("pipeline=1f1b", "trainer.global_batch_size=6") is None  # (the longer run's)
    assert pair("pipeline=gpipe") is None
    assert pair("pipeline=1f1b", "pipeline.pp_batch_size=10") is None
    assert pair("pipeline=interleaved", "model.config.num_hidden_layers=4",
                "trainer.global_batch_size=14") == (6, 8, 14)  # (3 pp and 4 pp)


@pytest.mark.fast
def test_the_short_runs_are_taken_where_they_cost_less_than_the_whole_schedule(monkeypatch):
    """The deep layouts run four short schedules a class (the deeper depth's longer one made
    of the others', ``microbatches.corner``): two depths at the smaller count, the shallow
    depth at the larger, the deeper at one round of pp; the whole schedule where that is
    cheaper."""
    from automodel.planning import depth
    from automodel.planning.plan import planned_runs

    monkeypatch.setattr(depth, "MIN_LAYERS_GATHERED", SHALLOW_FROM)

    def runs(*overrides):
        cfg = load_config([*LAYOUTS["deep_interleaved_ac"], *overrides],
                          env={"CUDA_VISIBLE_DEVICES": ""})
        pair, depths, runs, counts = planned_runs(cfg)
        return pair, sorted((counts[j], k) for j, k in runs)

    # 14 micro-batches (1 and 2 layers a stage): 4 short runs (6+12+8+4) against the whole
    # schedule's 14 + 28, with the builds
    assert runs() == ((6, 8, 14), [(2, 2), (6, 1), (6, 2), (8, 1)])
    assert runs("trainer.global_batch_size=12") == (None, [(None, 1), (None, 2)])
    assert runs("trainer.global_batch_size=64") == ((6, 8, 64), [(2, 2), (6, 1), (6, 2), (8, 1)])
