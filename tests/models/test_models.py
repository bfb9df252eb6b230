"""Model building, block discovery, and the techniques applied in parallelize()."""

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from automodel.compat import is_packed_sequence_patched, patch_is_packed_sequence
from automodel.config.schema import ModelConfig, SingleProcessConfig
from automodel.distributed.compile import apply_compile
from automodel.distributed.init import DistInfo
from automodel.distributed.setup import DistributedSetup
from automodel.models.builder import build_model
from automodel.models.parts import block_fqns, layer_groups, select_blocks
from automodel.parallelize import parallelize
from tests.distributed.test_parity import assert_matches
from tests.helpers import train

CONFIG = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 176,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 256, "rms_norm_eps": 1.0e-5, "tie_word_embeddings": False}


def _setup(**kwargs):
    info = DistInfo("gloo", torch.device("cpu"), 0, 1, 0)
    return DistributedSetup("none", SingleProcessConfig(), info, None, **kwargs)


@pytest.mark.fast
def test_blocks_groups_and_cache_off():
    model = build_model(ModelConfig(config=CONFIG), seed=0)
    assert model.config.use_cache is False
    assert block_fqns(model) == [f"model.layers.{i}" for i in range(4)]
    assert layer_groups(model) == {"language": block_fqns(model)}
    with pytest.raises(ValueError, match="no vision layers"):
        select_blocks(model, ["vision"])
    model.model.layers[0].requires_grad_(False)
    assert select_blocks(model, ["language"]) == [f"model.layers.{i}" for i in (1, 2, 3)]
    assert select_blocks(model, ["all"]) == block_fqns(model)



@pytest.mark.fast
def test_blocks_without_no_split_modules_and_blocks_that_share_a_weight():
    # GPT-1 declares no _no_split_modules: its blocks are the layer list's items
    gpt1 = build_model(ModelConfig(config={"model_type": "openai-gpt", "vocab_size": 256,
                                           "n_embd": 32, "n_layer": 3, "n_head": 2}), seed=0)
    assert not type(gpt1)._no_split_modules
    assert block_fqns(gpt1) == [f"transformer.h.{i}" for i in range(3)]
    # BERT lists its embeddings among _no_split_modules, but its word embedding is the LM
    # head's weight: not a block (FSDP2 keeps the tied weight in the root unit)
    bert = build_model(ModelConfig(config={
        "model_type": "bert", "is_decoder": True, "vocab_size": 256, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}), seed=0)
    assert bert.cls.predictions.decoder.weight is bert.bert.embeddings.word_embeddings.weight
    assert block_fqns(bert) == ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    bert.config.tie_word_embeddings = False
    untied = type(bert)(bert.config)
    assert "bert.embeddings" in block_fqns(untied)  # (not tied: a block of its own)

@pytest.mark.fast
def test_weights_the_model_freezes_stay_frozen_from_a_checkpoint(tmp_path):
    # Pegasus' sinusoidal positions are frozen by its constructor; from_pretrained loads them
    # trainable, the meta-device build of the distributed layouts keeps them frozen
    from automodel.models.builder import build_meta_model

    cfg = {"model_type": "pegasus", "vocab_size": 256, "d_model": 32, "decoder_layers": 1,
           "encoder_layers": 1, "decoder_attention_heads": 2, "encoder_attention_heads": 2,
           "decoder_ffn_dim": 64, "encoder_ffn_dim": 64, "max_position_embeddings": 64}
    build_model(ModelConfig(config=cfg), seed=0).save_pretrained(str(tmp_path))
    name = "model.decoder.embed_positions.weight"
    for model in (build_model(ModelConfig(pretrained_path=str(tmp_path)), seed=0),
                  build_meta_model(ModelConfig(pretrained_path=str(tmp_path)))):
        assert not dict(model.named_parameters())[name].requires_grad
    assert dict(model.named_parameters())["model.decoder.layers.0.fc1.weight"].requires_grad


@pytest.mark.fast
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_parallelize_wraps_blocks_and_keeps_parameter_names(mode):
    model = build_model(ModelConfig(config=CONFIG), seed=0)
    names = list(model.state_dict())
    expected = model(input_ids=torch.arange(8)[None]).logits
    [model] = parallelize(model, _setup(activation_checkpointing=mode, loss="plain")).parts
    assert all(isinstance(model.model.layers[i], CheckpointWrapper) for i in range(4))
    assert list(model.state_dict()) == names
    got = model(input_ids=torch.arange(8)[None]).logits
    torch.testing.assert_close(got, expected)


@pytest.mark.fast
def test_compile_keeps_state_dict_keys():
    model = build_model(ModelConfig(config=CONFIG), seed=0)
    names = list(model.state_dict())
    apply_compile(model, block_fqns(model))
    assert list(model.state_dict()) == names
    assert not any("_orig_mod" in n for n in model.state_dict())


@pytest.mark.fast
def test_patch_is_packed_sequence():
    from transformers import modeling_flash_attention_utils as fa

    packed = torch.tensor([[0, 1, 2, 0, 1, 2]])
    original = fa._is_packed_sequence
    try:
        assert bool(fa._is_packed_sequence(packed, 1)) is True
        patch_is_packed_sequence()
        assert is_packed_sequence_patched() and fa._is_packed_sequence(packed, 1) is False
    finally:
        fa._is_packed_sequence = original


def test_pretrained_path_loads_the_saved_weights(tmp_path, reference):
    # Save the weights a from-config run starts from (trainer.seed), then train from disk.
    build_model(ModelConfig(config=CONFIG), seed=1234).save_pretrained(tmp_path / "ckpt")
    records = train(["parallelism=ddp", "model=pretrained",
                     f"model.pretrained_path={tmp_path}/ckpt"],
                    tmp_path / "run")
    ref = reference()
    assert_matches(records, ref)  # losses and gradient norms, every step
    other = tmp_path / "other"
    build_model(ModelConfig(config=CONFIG), seed=7).save_pretrained(other)
    different = train(["parallelism=none", f"model.pretrained_path={other}"], tmp_path / "run2")
    assert abs(different[0]["loss"] - ref[0]["loss"]) > 1e-4
