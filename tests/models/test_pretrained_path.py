"""``model.pretrained_path=DIR`` alone loads DIR with its own config, whatever model preset is
chosen (the default, llama_tiny, has other sizes)."""

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.helpers import FP32, train


def test_pretrained_path_alone_loads_another_shape(tmp_path):
    config = AutoConfig.for_model("qwen2", vocab_size=300, hidden_size=48, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "ckpt")
    one = train(["parallelism=none", f"model.pretrained_path={tmp_path}/ckpt",
                 "trainer.max_steps=3"], tmp_path / "run")
    assert [r["step"] for r in one] == [1, 2, 3]
    log = (tmp_path / "run" / "train.log").read_text()
    assert "Qwen2ForCausalLM" in log  # the checkpoint's family and sizes, not llama_tiny's
    # FSDP2 + TP=2 (checked before launch on the checkpoint's own structure; each rank reads
    # its slices of the file) trains the same model: same losses and gradient norms
    tp = train(["parallelism=fsdp2", FP32, "mesh.tp_size=2", "trainer.max_steps=3",
                f"model.pretrained_path={tmp_path}/ckpt"], tmp_path / "tp")
    assert [r["step"] for r in tp] == [1, 2, 3]
    np.testing.assert_allclose([r["loss"] for r in tp], [r["loss"] for r in one], rtol=1e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in tp], [r["grad_norm"] for r in one],
                               rtol=1e-4)
