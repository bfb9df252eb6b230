"""A pipeline of many micro-batches planned from two short runs of its schedule
(automodel/planning/microbatches.py) equals the whole schedule's (and every layer's)
simulation: every number of every rank class (peak, memory parts, FLOPs, bytes and calls per
axis), on 1F1B with tp, interleaved with full AC and an image-text model under 1F1B, at the
fewest micro-batches the shortcut takes."""

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
                      "trainer.global_batch_size=10"],
    # interleaved (two stages a rank: 3 pp and 4 pp micro-batches), full AC, cut as well
    "deep_interleaved_ac": [*PP2[:3], "pipeline=interleaved", "trainer.global_batch_size=14",
                            "model.config.num_hidden_layers=16",
                            "parallelism.activation_checkpointing=full"],
    # an image-text model (never cut): its image batches along the line too
    "image_text_1f1b": [*PP2, "pipeline=1f1b", "model=llava_tiny", "data.image_every=2"],
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
    from automodel.planning.plan import rank_classes, simulate_classes

    monkeypatch.setattr(depth, "MIN_LAYERS_GATHERED", SHALLOW_FROM)
    cfg = load_config(LAYOUTS[name], env={"CUDA_VISIBLE_DEVICES": ""})
    assert (depth.shallow_depths(cfg) is None) == ("image_text" in name)  # (cut: the deep)
    pp, v = cfg.layout.pp, 2 if "interleaved" in name else 1
    assert microbatch_pair(cfg) == ((v + 1) * pp, (v + 2) * pp, (2 * v + 3) * pp)  # (taken)
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
    assert pair("pipeline=1f1b", "trainer.global_batch_size=8") is None  # (4 pp: all run)
    assert pair("pipeline=gpipe") is None
    assert pair("pipeline=1f1b", "pipeline.pp_batch_size=10") is None
    assert pair("pipeline=interleaved", "model.config.num_hidden_layers=4",
                "trainer.global_batch_size=14") == (6, 8, 14)  # (3 pp and 4 pp)
