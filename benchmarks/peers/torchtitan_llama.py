"""torchtitan 0.3.0 side of benchmarks/peers.py: a config registry module for its Trainer.

torchtitan 0.3.0 is configured in Python (``--module M --config F`` names a function that
returns a ``Trainer.Config``; command-line flags then override fields). This module holds
``llama_bench``: the llama3 model family at the benchmark's size, trained by torchtitan's own
Trainer with FSDP2, fp32 parameters and gradient reduction, no activation checkpointing, a
constant learning rate, and random tokens. It also holds the small pieces torchtitan has no
equivalent of for this benchmark, or that CPU ranks need:

* ``RandomTokens``: a dataloader of uniform random token ids (torchtitan's loaders read a
  Hugging Face data set and need a tokenizer; neither is reachable offline).
* ``NoTokenizer``: stands in for the tokenizer the Trainer always builds (random tokens need
  none, and the Hugging Face tokenizer needs files on disk).
* ``parallelize_for_gloo``: torchtitan's llama3 parallelisation plus plain SUM gradient
  reductions (gloo lacks the PREMUL_SUM reduction torchtitan's FSDP setup asks for).
* ``TimedTrainer``: the stock Trainer with a clock around its steps. After each step rank 0
  prints one ``PEERS_STEP {json}`` line: the wall time since the previous step ended (for the
  first step: since ``train()`` started) and the Unix time, which peers.py parses.

Attention: torchtitan's llama3 registry only offers FlexAttention (compiled with inductor's
max-autotune, tuned for GPUs) or varlen attention (CUDA only) for language models. This
config swaps in torchtitan's own ``ScaledDotProductAttention`` module (plain causal SDPA, no
compilation), the same kernel the other sides use. Everything else in the layers comes from
torchtitan's own llama3 layer builder (fused QKV projection, SwiGLU feed-forward, RMSNorm,
complex RoPE).

SPMD backend: ``partial_dtensor`` (plain FSDP2 over the data-parallel mesh) instead of the
default ``spmd_types``, whose parameters ``fully_shard`` in torch 2.13.0 rejects.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.llama3 import (
    _EMBEDDING_INIT,
    _NORM_INIT,
    _build_llama3_layers,
    _output_linear_init,
)
from torchtitan.models.llama3.model import Llama3Model
from torchtitan.models.llama3.parallelize import parallelize_llama
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

# The benchmark's model and batch (the same numbers peers.py gives every side).
VOCAB = 32000
DIM = 256
FFN = 768
LAYERS = 4
HEADS = 8
KV_HEADS = 8
SEQ_LEN = 256
LOCAL_BATCH = 2
SEED = 1234


class NoTokenizer(BaseTokenizer):
    """The Trainer always builds a tokenizer; random token ids need none."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = VOCAB

    def __init__(self, config: Config, **_runtime):
        super().__init__()
        self.vocab_size = config.vocab_size

    def encode(self, *args, **kwargs) -> list[int]:
        raise NotImplementedError("the benchmark feeds random token ids")

    def decode(self, *args, **kwargs) -> str:
        raise NotImplementedError("the benchmark feeds random token ids")

    def get_vocab_size(self) -> int:
        return self.vocab_size


class RandomTokens(BaseDataLoader):
    """Endless uniform random token sequences, one stream per data-parallel rank.

    Yields what torchtitan's text loaders yield: ``({"input": ids[:, :-1]}, ids[:, 1:])``
    with ``local_batch_size`` rows of ``seq_len`` tokens (no per-document positions, so
    attention is plainly causal over the whole sequence)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        vocab_size: int = VOCAB
        seed: int = SEED

    def __init__(self, config: Config, *, dp_rank: int, seq_len: int, local_batch_size: int,
                 **_runtime):
        self.config = config
        self.dp_rank = dp_rank
        self.seq_len = seq_len
        self.batch = local_batch_size

    def __iter__(self):
        gen = torch.Generator().manual_seed(self.config.seed + self.dp_rank)
        while True:
            ids = torch.randint(0, self.config.vocab_size, (self.batch, self.seq_len + 1),
                                generator=gen)
            yield {"input": ids[:, :-1]}, ids[:, 1:]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class TimedTrainer(Trainer):
    """torchtitan's Trainer, unchanged, plus a per-step wall clock printed by rank 0."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def train(self):
        self._peers_last = time.perf_counter()
        return super().train()

    def train_step(self, data_iterator):
        super().train_step(data_iterator)
        now = time.perf_counter()
        seconds, self._peers_last = now - self._peers_last, now
        if torch.distributed.get_rank() == 0:
            record = {"step": self.step, "seconds": seconds, "unix_time": time.time()}
            print("PEERS_STEP " + json.dumps(record), flush=True)


def parallelize_for_gloo(model, **kwargs):
    """torchtitan's llama3 parallelisation, then one setting gloo needs.

    torchtitan turns off FSDP's gradient averaging (gradient divide factor 1: the loss is
    already divided by the global token count), which makes FSDP reduce-scatter with
    ``ReduceOp.PREMUL_SUM(1.0)``; gloo has no PREMUL_SUM. Forcing plain SUM reductions
    computes the same (FSDP skips its division by 1)."""
    from torch.distributed.fsdp import FSDPModule

    model = parallelize_llama(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


def _model() -> Llama3Model.Config:
    head_dim = DIM // HEADS
    layers = _build_llama3_layers(
        n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=FFN,
        rope=ComplexRoPE.Config(dim=head_dim, max_seq_len=SEQ_LEN, theta=10000.0),
        attn_backend="flex", fuse_qkv=True)
    for layer in layers:  # see the module docstring: SDPA instead of compiled FlexAttention
        for _, _, parent, attr in layer.traverse(FlexAttention.Config):
            setattr(parent, attr, ScaledDotProductAttention.Config())
    return Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        enable_weight_tying=False,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                              param_init=_output_linear_init(DIM)),
        layers=layers,
    )


def llama_bench() -> TimedTrainer.Config:
    spec = ModelSpec(name="llama3", flavor="peers_bench", model=_model(),
                     parallelize_fn=parallelize_for_gloo, pipelining_fn=pipeline_llm,
                     post_optimizer_build_fn=None, state_dict_adapter=None)
    return TimedTrainer.Config(
        model_spec=spec,
        hf_assets_path=".",  # nothing is read from it (no tokenizer, no checkpoint)
        tokenizer=NoTokenizer.Config(),
        dataloader=RandomTokens.Config(),
        # torchtitan's llama3 default: the LM head runs inside the loss, in chunks.
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=VOCAB)),
        optimizer=default_adamw(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=0, min_lr_factor=1.0),
        training=TrainingConfig(
            local_batch_size=LOCAL_BATCH,
            seq_len=SEQ_LEN,
            steps=30,
            max_norm=1.0,
            dtype="float32",
            mixed_precision_param="float32",   # torchtitan's default is bf16 parameters
            mixed_precision_reduce="float32",
            disable_cuda_graphs=True,
        ),
        # "partial_dtensor": plain FSDP2 over the data-parallel mesh. torchtitan's default,
        # "spmd_types", hands fully_shard parameters that this torch release rejects.
        parallelism=ParallelismConfig(data_parallel_shard_degree=2,
                                      spmd_backend="partial_dtensor"),
        metrics=MetricsProcessor.Config(log_freq=1),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None,  # torchtitan defaults to selective AC; the others use none
    )
