"""Mixed precision under FSDP2: the default ``mp_policy`` and frozen image-text towers.

The default (``mp_policy: null``) computes in bf16 with fp32 gradient reduction and keeps the
dtypes of module inputs and outputs (``output_dtype: null``, ``cast_forward_inputs: false``).
Every shipped family, text and image-text, takes a step under it on two ranks, close to its
fp32 step at the bf16 tolerances (``test_parity.py``), having really computed in bf16.

Image-text models with a frozen vision tower: every ``multimodal.frozen_sharding`` policy and
``multimodal.vision`` setting takes a step in each precision (the default, fp32, autocast to
bf16 over fp32 weights); the tower runs in the dtype the precision asks for, under
``replicate`` too (its weights are outside FSDP2), and under the default all settings compute
the same numbers (with torch's ``cast_forward_inputs=True``, Qwen2-VL's fp32 rotary tables were
cast to bf16 at each vision block and ``per_layer`` differed). Whole jobs: ``replicate`` under
the default (LLaVA, Qwen2-VL) and under autocast (LLaVA), 5 steps, close to the fp32
single-process run.

The in-process checks are one step each of the real step function (``recipes/step.py``) on
real gloo ranks (``run_on_ranks``): far cheaper than a job per combination.
"""

import numpy as np
import pytest
import torch

from tests.distributed.test_parity import (
    BF16_GRAD_RTOL_FIRST_STEP,
    assert_close_to_fp32,
)
from tests.helpers import BASE, FP32, run_on_ranks, train

AUTOCAST = ["parallelism.autocast_dtype=bfloat16"]
PRECISIONS = {"default": [], "fp32": [FP32], "autocast": AUTOCAST + [FP32]}
FROZEN = ["model.freeze=[vision]", "data.image_every=2"]
_MM = "parallelism.multimodal."
SETTINGS = {  # frozen_sharding x multimodal.vision
    "root": [f"{_MM}frozen_sharding=root"],
    "per_layer": [f"{_MM}frozen_sharding=per_layer", f"{_MM}vision.reshard_after_forward=true"],
    "replicate": [f"{_MM}frozen_sharding=replicate"],
    "per_layer_tower": [f"{_MM}frozen_sharding=per_layer", f"{_MM}vision.unit=tower",
                        f"{_MM}vision.reshard_after_forward=false"],
    "replicate_tower": [f"{_MM}frozen_sharding=replicate", f"{_MM}vision.unit=tower"],
}
LOSS_RTOL = 2e-2  # bf16 against fp32 (test_parity.py's bf16 tests)


def _observe(model):
    """Hooks recording what the model computes in: the dtype of the first floating input the
    vision tower receives, the (weight, output) dtypes of its frozen matmuls, the output dtype
    of the first language block."""
    from automodel.models.parts import block_fqns, group_of, vision_tower

    seen = {"tower_input": set(), "tower_compute": set(), "block_output": set()}

    def tower_input(mod, args, kwargs):
        floats = [t for t in [*args, *kwargs.values()]
                  if isinstance(t, torch.Tensor) and t.is_floating_point()]
        seen["tower_input"].add(str(floats[0].dtype))

    def compute(mod, args, out):
        seen["tower_compute"].add((str(mod.weight.dtype), str(out.dtype)))

    tower = vision_tower(model)
    if tower is not None:
        tower = model.get_submodule(tower)
        tower.register_forward_pre_hook(tower_input, with_kwargs=True)
        for m in tower.modules():
            if (isinstance(m, (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Conv3d))
                    and not m.weight.requires_grad):
                m.register_forward_hook(compute)
    first = next(f for f in block_fqns(model) if group_of(f) == "language")
    model.get_submodule(first).register_forward_hook(
        lambda mod, args, out: seen["block_output"].add(
            str((out[0] if isinstance(out, tuple) else out).dtype)))
    return seen


def _cached(fn, copy):
    """``fn(...)`` computed once per distinct arguments; each call gets ``copy(value)``, with
    the random-number state ``fn`` left."""
    memo = {}

    def get(*args):
        key = repr(args)
        if key not in memo:
            memo[key] = (fn(*args), torch.get_rng_state())
        value, rng = memo[key]
        torch.set_rng_state(rng)
        return copy(value)

    return get


def _one_step(rank, world, runs):
    """One training step per run (a list of overrides) on these ranks: loss, grad norm and
    what ``_observe`` saw. The model is built once per preset (a run repeats its initial
    weights)."""
    import copy
    import warnings

    from automodel.api import load_config
    from automodel.data.batches import BatchPlan
    from automodel.data.sources import training_data
    from automodel.distributed.init import DistInfo
    from automodel.parallelize import parallelize
    from automodel.recipes import components
    from automodel.recipes import train as runner
    from automodel.recipes.router_loss import RouterLoss
    from automodel.recipes.step import train_step

    warnings.filterwarnings("ignore")
    components.build_meta_model = _cached(components.build_meta_model, copy.deepcopy)
    components.full_initial_state = _cached(components.full_initial_state, dict)  # (emptied by use)
    data, results = {}, []
    for overrides in runs:
        cfg = load_config(BASE + ["parallelism=fsdp2", "trainer.local_batch_size=4",
                                  f"distributed.nproc_per_node={world}"] + overrides)
        info = DistInfo("gloo", torch.device("cpu"), rank, world, rank)
        setup = runner.build_setup(cfg, info)
        model, fill = components.initial_model(cfg, info)
        router_loss = RouterLoss.of(model)
        seen = _observe(model)
        parallel = parallelize(model, setup, fill)
        key = repr((cfg.model, cfg.data))
        if key not in data:
            t = cfg.trainer
            rows, _ = training_data(cfg.data_source, cfg.data, t.seq_len, cfg.model)
            data[key] = BatchPlan(rows, t.global_batch_size, t.seed).micro_batches(
                0, setup.dp_rank, setup.dp_size, t.local_batch_size)
        stats = train_step(parallel.parts[0], setup, data[key], cfg.optim.max_grad_norm,
                           router_loss, parallel.head_loss)
        results.append(dict(loss=float(stats.loss), grad_norm=float(stats.grad_norm), **seen))
    return results


def _close_to_fp32(got, fp32, what):
    np.testing.assert_allclose(got["loss"], fp32["loss"], rtol=LOSS_RTOL, err_msg=what)
    np.testing.assert_allclose(got["grad_norm"], fp32["grad_norm"],
                               rtol=BF16_GRAD_RTOL_FIRST_STEP, err_msg=what)
    assert got["loss"] != fp32["loss"], f"{what}: did it compute in bf16 at all?"


@pytest.mark.fast
def test_default_mp_policy_is_the_references():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from automodel.config.policies import resolve_policy
    from automodel.distributed.fsdp2 import build_policy

    policy = build_policy(resolve_policy("parallelism.mp_policy", None), torch.device("cpu"))
    assert policy == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                          output_dtype=None, cast_forward_inputs=False)


def _presets():
    """The shipped tiny presets: (text ones, image-text ones)."""
    import os

    text, image_text = [], []
    for name in sorted(os.listdir("conf/model")):
        if name.endswith("_tiny.yaml"):
            with open(os.path.join("conf/model", name), encoding="utf-8") as f:
                has_vision = "vision_config:" in f.read()
            (image_text if has_vision else text).append(name[:-len(".yaml")])
    return text, image_text


def test_every_text_family_steps_under_the_default_mp_policy(tmp_path):
    # (the image-text families: the test below)
    text, _ = _presets()
    assert len(text) >= 15
    runs = [r for preset in text for r in ([f"model={preset}"], [f"model={preset}", FP32])]
    results = run_on_ranks(_one_step, 2, runs, tmp_path=tmp_path)[0]
    for preset, bf16, fp32 in zip(text, results[::2], results[1::2]):
        _close_to_fp32(bf16, fp32, preset)
        assert bf16["block_output"] == {"torch.bfloat16"}, preset
        assert fp32["block_output"] == {"torch.float32"}, preset


# what the tower's frozen matmuls compute in: (weight dtype, output dtype)
TOWER_COMPUTE = {"default": {("torch.bfloat16", "torch.bfloat16")},
                 "fp32": {("torch.float32", "torch.float32")},
                 "autocast": {("torch.float32", "torch.bfloat16")}}
# Which settings run in each precision. fp32: the base (no cast anywhere, no swap; each policy
# matches one process in test_image_text.py). Autocast over fp32 weights: FSDP2 casts nothing,
# so the two settings furthest from root.
RUN = {"default": list(SETTINGS), "fp32": ["root"], "autocast": ["replicate", "per_layer_tower"]}


FROZEN_LAYER_0 = ("parallelism.pre_shard_hook="
                  "tests.distributed.test_image_text.freeze_first_language_layer")


def test_frozen_tower_policies_and_vision_settings_in_each_precision(tmp_path):
    _, image_text = _presets()
    assert {"llava_tiny", "qwen2_vl_tiny", "gemma3_vl_tiny"} <= set(image_text)
    keys = [(preset, precision, setting) for preset in image_text
            for precision, settings in RUN.items() for setting in settings]
    runs = [[f"model={p}"] + FROZEN + PRECISIONS[prec] + SETTINGS[s] for p, prec, s in keys]
    # and a frozen block that backward passes through (the embeddings below it train),
    # recomputed under activation checkpointing: the replicated copies serve both
    frozen_block = ["model=llava_tiny", "model.freeze=[vision]", FROZEN_LAYER_0,
                    "parallelism.activation_checkpointing=full"]
    runs += [frozen_block + SETTINGS["root"], frozen_block + SETTINGS["replicate"]]
    *results, block_root, block_replicate = run_on_ranks(_one_step, 2, runs, tmp_path=tmp_path)[0]
    assert (block_replicate["loss"], block_replicate["grad_norm"]) == pytest.approx(
        (block_root["loss"], block_root["grad_norm"]), rel=1e-6)
    results = dict(zip(keys, results))
    for (preset, precision, setting), got in results.items():
        what = f"{preset} {precision} {setting}"
        assert got["tower_compute"] == TOWER_COMPUTE[precision], (what, got["tower_compute"])
        fp32 = results[(preset, "fp32", "root")]
        if precision == "default":
            # replicate's tower computes in what root and per_layer gather it in: the same
            # numbers under every policy and vision setting
            root = results[(preset, precision, "root")]
            np.testing.assert_allclose([got["loss"], got["grad_norm"]],
                                       [root["loss"], root["grad_norm"]], rtol=1e-6,
                                       err_msg=what)
        if precision != "fp32":
            _close_to_fp32(got, fp32, what)
    for preset in ("llava_tiny", "gemma3_vl_tiny"):  # (Qwen2-VL casts its images itself)
        # inputs keep their dtype: the images reach the tower as the data made them (torch's
        # cast_forward_inputs=True would cast them to bf16 at the root)
        assert results[(preset, "default", "root")]["tower_input"] == {"torch.float32"}


# (LLaVA on mixed batches: a gradient-norm excursion at step 3 in bf16, the same in one process
# and in every layout; on images in every sample it stays within the bf16 tolerances)
@pytest.mark.parametrize("name,overrides", [
    ("llava_default", ["model=llava_tiny", "model.freeze=[vision]", "trainer.local_batch_size=2"]),
    ("llava_autocast", ["model=llava_tiny", "model.freeze=[vision]", "trainer.local_batch_size=2",
                        FP32] + AUTOCAST),
    # (Gemma 3's tower and projector are laid out as LLaVA's: step 1 above)
    ("qwen2_vl_default", ["model=qwen2_vl_tiny"] + FROZEN + ["trainer.local_batch_size=1"]),
])
def test_replicated_frozen_tower_close_to_fp32(name, overrides, reference, tmp_path):
    # the frozen tower outside FSDP2, 5 steps (Qwen2-VL: its frozen blocks replicated inside a
    # tower whose merger trains; one rank without images at times); the fp32 references are
    # those of test_image_text.py
    records = train(["parallelism=fsdp2", "mesh.dp_size=2", f"{_MM}frozen_sharding=replicate"]
                    + overrides, tmp_path)
    data = [o for o in overrides if o.startswith(("model=", "model.freeze", "data."))]
    assert_close_to_fp32(records, reference(*data), loss_rtol=LOSS_RTOL)
