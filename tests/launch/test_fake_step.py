"""The preflight's fake step (``automodel/checks/fake_step.py``): a layout that would crash in
its first step is refused before launch, naming the family, the layout, the rank and the
module; one that trains passes. In this process, on fake tensors, with a fake process group
that is gone afterwards (no rank, no real group)."""

import logging

import pytest
import torch.distributed as dist

from automodel.api import load_config
from automodel.checks import fake_step
from automodel.checks.preflight import preflight
from automodel.config.build import ConfigError
from tests.helpers import FP32

pytestmark = pytest.mark.fast

# splits q over the TP ranks but not k, v or o: o_proj gets half its input (a shape error)
Q_ONLY = "parallelism.tp_plan={model.layers.*.self_attn.q_proj:colwise}"


def _cfg(*overrides):
    return load_config(["data=synthetic", *overrides])


def _refusal(*overrides) -> str:
    with pytest.raises(ConfigError) as info:
        preflight(_cfg(*overrides))
    assert not dist.is_initialized()  # (the fake group is gone)
    return str(info.value)


def test_a_layout_that_would_crash_is_refused_naming_family_layout_and_module():
    msg = _refusal("mesh.tp_size=2", Q_ONLY)
    assert msg.startswith("LlamaForCausalLM (model_type 'llama') cannot train with "
                          "parallelism=fsdp2 pipeline=none tp 2")
    assert "fails in model.layers.0.self_attn.o_proj: RuntimeError" in msg
    assert "distributed.preflight_step=false" in msg
    # the option turns it off: the same layout passes the preflight (and would crash)
    preflight(_cfg("mesh.tp_size=2", Q_ONLY, "distributed.preflight_step=false"))


def test_every_kind_of_pipeline_rank_takes_a_step():
    # the LM head runs on the last stage only: split row-wise it takes half its input, and
    # pp rank 1 of 2 is refused (rank 0 passed); the message gives the model's own error
    msg = _refusal("pipeline=1f1b", "pipeline.pp_microbatch_size=2", "mesh.tp_size=2",
                   "trainer.loss=plain", "parallelism.tp_plan={lm_head:rowwise}")
    assert "one training step of pp rank 1 (rank 2)" in msg
    assert "fails in lm_head: RuntimeError: a and b must have same reduction dim" in msg
    # ranks whose stages are alike are stepped once: interleaved pp 4 has 3 kinds
    cut, layers = fake_step.cut_down(_cfg("pipeline=interleaved", "mesh.pp_size=4",
                                          "model.config.num_hidden_layers=16",
                                          "trainer.global_batch_size=16"))
    assert layers == 8 and cut.trainer.local_batch_size == 4  # 1 per stage; 4 micro-batches
    assert [c.rank for c in fake_step.distinct_rank_classes(cut)] == [0, 1, 3]


def test_layouts_that_train_pass_and_say_so(caplog):
    with caplog.at_level(logging.INFO, logger="automodel.checks.fake_step"):
        preflight(_cfg("mesh.tp_size=2"))
    assert "one step of parallelism=fsdp2 pipeline=none tp 2 on fake tensors (1 rank " \
        "class, 1 layer)" in caplog.text
    # what this issue made train: global head counts under TP; positions and an embedding
    # norm before the blocks, a decoder one level down, under a pipeline
    preflight(_cfg("model=stablelm_tiny", "mesh.tp_size=2", "mesh.dp_size=1",
                   "parallelism.sequence_parallel=true"))
    # (the families under a pipeline: tests/launch/test_fake_step_families.py, full tier)


def broken_loss(logits, labels):
    """A ``pipeline.loss_fn`` that fails: the schedule runs it outside the model."""
    raise RuntimeError("this loss is broken on purpose")


def test_a_failure_outside_the_model_is_the_simulation_s_limit_not_a_refusal(caplog):
    # what fails outside the model's forward (here the pipeline's loss; elsewhere what the
    # fake tensors cannot do) is logged, and the job starts unchecked
    with caplog.at_level(logging.WARNING, logger="automodel.checks.fake_step"):
        preflight(_cfg("pipeline=1f1b", "pipeline.pp_microbatch_size=2",
                       "pipeline.loss_fn=tests.launch.test_fake_step.broken_loss"))
    assert "could not run pp rank 1 outside the model's forward (RuntimeError: this loss " \
        "is broken on purpose)" in caplog.text


def test_a_step_past_the_time_bound_is_cut_short_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(fake_step, "TIME_BOUND_SECONDS", 1e-3)
    with caplog.at_level(logging.WARNING, logger="automodel.checks.fake_step"):
        preflight(_cfg("mesh.tp_size=2", Q_ONLY))  # (would be refused, given the time)
    assert "did not finish within 0 s and was cut short" in caplog.text
    assert not dist.is_initialized()


def test_the_bound_never_ends_the_step_inside_a_lock_holder(monkeypatch):
    # a raise inside logging's critical section would leave its module lock held, and every
    # later log call of the process (a SLURM watcher's thread) would wait for it forever
    import signal
    import sys

    frames = {}

    class Probe(logging.Handler):
        def emit(self, record):
            frames["in logging"] = sys._getframe()

    logger = logging.getLogger("automodel.tests.probe")
    logger.addHandler(Probe())
    logger.warning("probe")
    rearmed = []
    monkeypatch.setattr(signal, "setitimer", lambda which, seconds: rearmed.append(seconds))
    fake_step._expire(signal.SIGALRM, frames["in logging"])  # deferred, not raised
    assert rearmed == [0.02]
    # nor inside c10d, which makes and destroys the fake world's group (a raise there left a
    # group behind: the next preflight found it, 2 runs in 16)
    c10d = {"__name__": "torch.distributed.distributed_c10d"}
    exec("import sys\nframe = sys._getframe()", c10d)  # (a frame running in c10d's globals)
    fake_step._expire(signal.SIGALRM, c10d["frame"])
    assert rearmed == [0.02, 0.02]
    with pytest.raises(fake_step._OutOfTime):
        fake_step._expire(signal.SIGALRM, sys._getframe())


def test_the_cut_keeps_each_kind_of_layer():
    # DeepSeek-V3: 3 dense layers, then MoE ones; cut to 2, one of each
    cut, layers = fake_step.cut_down(_cfg("model=deepseek_v3", "mesh.ep_size=2",
                                          "mesh.dp_size=2"))
    assert layers == 2 and cut.model.config["first_k_dense_replace"] == 1
    # a list per layer keeps the first layer of each kind
    types = ["sliding_attention"] * 5 + ["full_attention"]
    cut, layers = fake_step.cut_down(_cfg(
        "model=pretrained", "+model.config.model_type=gemma3_text", "mesh.tp_size=2",
        "+model.config.num_hidden_layers=6", f"+model.config.layer_types=[{','.join(types)}]",
        "+model.config.vocab_size=256", "+model.config.hidden_size=64",
        "+model.config.num_attention_heads=4", "+model.config.num_key_value_heads=2",
        "+model.config.head_dim=16", "+model.config.intermediate_size=128"))
    assert layers == 2
    assert cut.model.config["layer_types"] == ["sliding_attention", "full_attention"]


def test_a_router_kept_in_float32_is_a_unit_of_its_own():
    # DeepSeek-V3 keeps its MoE gate in float32 among bf16 weights; FSDP2 takes one dtype
    # per unit (it raised "FSDP expects uniform original parameter dtype" in the MoE layers
    # before the gate became a unit of its own): the fake step runs a MoE layer of each
    preflight(_cfg("model=deepseek_v3", "mesh.ep_size=2", "mesh.dp_size=2",
                   "trainer.global_batch_size=2", "trainer.seq_len=64"))
    from automodel.distributed.fsdp2 import own_dtype_modules
    from automodel.models.builder import build_meta_model

    cut, _ = fake_step.cut_down(_cfg("model=deepseek_v3", "mesh.ep_size=2", "mesh.dp_size=2"))
    model = build_meta_model(cut.model)
    moe = model.model.layers[1]
    assert own_dtype_modules(moe, [moe.mlp.experts]) == [moe.mlp.gate]
    assert own_dtype_modules(model.model.layers[0]) == []  # a dense layer: one dtype


def test_a_forward_that_reads_tensor_values_is_not_refused(caplog):
    # JetMoE's router takes .item() of its counts: fake tensors have no values, so the step
    # cannot go on there; that is the simulation's limit, not the layout's (it trains)
    with caplog.at_level(logging.WARNING, logger="automodel.checks.fake_step"):
        preflight(_cfg("model=pretrained", "+model.config.model_type=jetmoe",
                       "+model.config.vocab_size=256", "+model.config.hidden_size=64",
                       "+model.config.num_hidden_layers=2", "+model.config.num_attention_heads=4",
                       "+model.config.num_key_value_heads=2", "+model.config.kv_channels=16",
                       "+model.config.intermediate_size=128", "+model.config.num_local_experts=4",
                       "pipeline=1f1b", "pipeline.pp_microbatch_size=2"))
    assert "reads tensor values (DataDependentOutputException)" in caplog.text


def test_a_model_that_converts_a_module_while_it_builds_builds_under_the_fake_mode():
    # (Inkling casts its short convolutions to float32 in __init__: fake parameters could not
    # be swapped in place, and the fake step stopped outside the forward, unchecked)
    import torch
    from torch import nn

    from automodel.compat import parameters_on_meta
    from automodel.compat.planning import fake_tensor_mode

    class Casts(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(4, 4, 3, dtype=torch.bfloat16).to(dtype=torch.float32)

    with fake_tensor_mode(), parameters_on_meta():
        module = Casts()
    assert module.conv.weight.dtype == torch.float32 and module.conv.weight.is_meta


def test_a_model_that_runs_its_layers_twice_is_refused_under_a_pipeline():
    # Dory's forward loops over a recurrent section of its layers: a stage would run its
    # share once (silently wrong before: off by 4e-4 in the loss against one process)
    message = _refusal("model=dory_tiny", "parallelism=fsdp2", "pipeline=1f1b")
    assert "DoryForCausalLM" in message and "more than once in one pass" in message
    assert "pipeline=none" in message


def test_a_family_that_fails_with_cast_weights_is_refused_under_the_default_precision(caplog):
    # GPT-1's attention multiplies by a float32 mask buffer: with weights cast to bfloat16
    # (the default mp_policy) its next matmul meets two dtypes. One process trains in float32,
    # so a layout of data parallelism alone is stepped too when the policy casts
    gpt1 = ["model.config.model_type=openai-gpt", "parallelism=fsdp2"]
    message = _refusal(*gpt1)
    assert message.startswith("OpenAIGPTLMHeadModel (model_type 'openai-gpt') cannot train "
                              "with parallelism=fsdp2 pipeline=none dp_shard 2")
    assert "fails in transformer.h.0.attn" in message
    assert "param_dtype:float32" in message  # (the fix, not another layout)
    with caplog.at_level(logging.INFO, logger="automodel.checks.fake_step"):
        preflight(_cfg(*gpt1, FP32))  # float32 weights: nothing to check, not stepped
    assert "on fake tensors" not in caplog.text


def test_an_image_text_model_is_cut_in_its_text_config_and_its_tower():
    """A composite config ignores text keys at its top level (the language model kept all of
    its layers: LLaVA-NeXT-72B's fake step ran 80 and hit the time bound): the cut goes into
    ``text_config``; the tower is cut to two layers, or to the deepest one it reads."""
    from automodel.models import multimodal as mm
    from automodel.models.builder import hf_config

    cfg = _cfg("model=llava_tiny", "pipeline=1f1b", "mesh.pp_size=2",
               "model.config.vision_config.num_hidden_layers=6")
    cut, layers = fake_step.cut_down(cfg)
    assert layers == 2 and mm.text_config(hf_config(cut.model)).num_hidden_layers == 2
    config = hf_config(cut.model)
    assert config.text_config.hidden_size == 64  # (the rest of the text config kept)
    tower = mm.tower_cut(config)
    assert tower["vision_config"]["num_hidden_layers"] == 2
    assert tower["vision_config"]["hidden_size"] == 32
    config.vision_feature_layer = [-5, 3]
    assert mm.tower_cut(config)["vision_config"]["num_hidden_layers"] == 5
    config.vision_feature_layer = -6
    assert mm.tower_cut(config) is None  # (it reads the first layer's input: all 6 kept)
    assert mm.tower_cut(mm.text_config(config)) is None  # (no tower)


def test_a_tower_that_fails_once_cut_is_stepped_whole(monkeypatch, caplog):
    """Where the cut tower fails (here a cut to one layer while the model reads the input of
    the second-to-last of its two: an index past the cut tower's hidden states), the fake
    step runs again with the whole tower, which passes: a cut never refuses a layout that
    trains, nor leaves it unchecked."""
    from automodel.models import multimodal as mm

    def bad_cut(config, layers=2):
        return {"vision_config": {**config.vision_config.to_dict(), "num_hidden_layers": 1}}

    monkeypatch.setattr(mm, "tower_cut", bad_cut)
    with caplog.at_level(logging.INFO, logger="automodel.checks.fake_step"):
        preflight(_cfg("model=llava_tiny", "mesh.tp_size=2",
                       "model.config.vision_feature_layer=-3"))
    assert "with the vision tower cut to 1 layers fails (" in caplog.text
    assert "stepping the whole tower" in caplog.text and "WARNING" not in caplog.text
    assert "one step of parallelism=fsdp2 pipeline=none tp 2 on fake tensors" in caplog.text


def _register_a_model_that_fails_in_every_layout():
    """A Llama whose MLP raises in its forward (in one process as under any layout),
    registered with transformers under its own model type for this process."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaMLP

    class BrokenConfig(LlamaConfig):
        model_type = "automodel_test_broken"

    class BrokenMLP(LlamaMLP):
        def forward(self, x):
            raise ValueError("this MLP is broken in every layout")

    class BrokenForCausalLM(LlamaForCausalLM):
        config_class = BrokenConfig

        def __init__(self, config):
            super().__init__(config)
            for layer in self.model.layers:
                layer.mlp.__class__ = BrokenMLP

    if BrokenConfig.model_type not in AutoConfig.for_model.__globals__["CONFIG_MAPPING"]:
        AutoConfig.register(BrokenConfig.model_type, BrokenConfig)
        AutoModelForCausalLM.register(BrokenConfig, BrokenForCausalLM)
    return BrokenConfig.model_type


def test_a_failure_no_layout_causes_says_so_and_gives_the_real_error():
    """A forward that fails in one process too is not blamed on the layout: the message says
    no layout avoids it and where the error was raised; a layout's own failure still names
    the layout keys this job set (and only those)."""
    model_type = _register_a_model_that_fails_in_every_layout()
    msg = _refusal(f"model.config.model_type={model_type}", "mesh.tp_size=2")
    assert "cannot train: one training step" in msg
    assert "fails in model.layers.0.mlp: ValueError: this MLP is broken in every layout " \
           "(raised in tests/launch/test_fake_step.py:" in msg
    assert "no layout avoids it" in msg and "Choose another" not in msg
    msg = _refusal("mesh.tp_size=2", Q_ONLY)  # (the layout's own failure)
    assert "One process without parallelism takes the same step" in msg
    assert "Choose another layout, without mesh.tp_size=2 (" in msg
    assert "pipeline" not in msg.split("Choose another")[1]
