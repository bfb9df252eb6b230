"""Closed-form memory and FLOPs of a dense transformer, to cross-check the planner's simulation.

- ``korthikanti_layer_bytes``: the activation bytes of one layer from Korthikanti et al., 2022
  ("Reducing Activation Recomputation in Large Transformer Models", Table 2), as printed: a
  GPT block (LayerNorm, explicit attention scores with softmax and dropout, a 4h GeLU MLP,
  dropout after attention and MLP), 16-bit activations, Megatron's tensor and sequence
  parallelism.
- ``llama_layer_bytes``: the same count redone for what automodel runs on a Llama block
  (``Dense``): the tensors autograd saves in ``LlamaDecoderLayer`` in bf16, with SDPA / flash
  attention (no s x s score matrix is kept: the 5as/h term is gone), grouped-query attention
  passed to SDPA unrepeated, RMSNorm (which saves an fp32 copy of its input), a SwiGLU MLP of
  width ``ffn``, no dropout, torch's tensor parallelism (DTensor) and automodel's selective
  checkpointing policy (``distributed/activation_checkpointing.py``: the outputs of matmuls
  and of attention are kept, everything else is recomputed). docs/planning.md derives it.
- ``model_state_bytes``: parameters, gradients and AdamW's two moments under FSDP2 with
  automodel's default mixed precision (parameters and optimizer states in the model's dtype,
  gradients reduced in fp32 and stored in the parameters' dtype); ``megatron_state_bytes``
  for comparison (fp32 master weights, 18 bytes a parameter).
- ``training_flops``: 6 FLOPs per matmul parameter per token, plus attention.

Torch-free: plain arithmetic on the model's published sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

AC_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class Dense:
    """A Llama-style decoder: sizes as in its ``config.json``."""

    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    layers: int
    vocab: int
    tied: bool = False

    @classmethod
    def from_config(cls, c: dict) -> "Dense":
        return cls(c["hidden_size"], c["intermediate_size"], c["num_attention_heads"],
                   c.get("num_key_value_heads") or c["num_attention_heads"],
                   c["num_hidden_layers"], c["vocab_size"], bool(c.get("tie_word_embeddings")))

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    def layer_matmul_parameters(self) -> int:
        """q, k, v, o and gate, up, down (no biases)."""
        h = self.hidden
        return 2 * h * h + 2 * h * self.kv_dim + 3 * h * self.ffn

    def layer_parameters(self) -> int:
        return self.layer_matmul_parameters() + 2 * self.hidden  # + two RMSNorm weights

    def parameters(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.layer_parameters() + embeddings + self.hidden

    def matmul_parameters(self) -> int:
        """The parameters a token multiplies: the layers' matmuls and the LM head (the
        embedding is a lookup)."""
        return self.layers * self.layer_matmul_parameters() + self.vocab * self.hidden


def _check(t: int, ac: str) -> None:
    if t < 1:
        raise ValueError(f"tensor-parallel degree {t} must be >= 1")
    if ac not in AC_MODES:
        raise ValueError(f"checkpointing mode {ac!r}: one of {', '.join(AC_MODES)}")


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            ac: str = "none", scores: bool = True) -> float:
    """Table 2 of the paper: one layer's activation bytes. ``scores=False`` drops the
    5as/h term (the s x s softmax input and output and dropout mask), which flash / SDPA
    attention never stores."""
    _check(t, ac)
    sbh = s * b * h
    score = 5 * a * s / h if scores else 0.0
    if ac == "full":
        return 2 * sbh
    if ac == "selective":  # (the attention core recomputed: no score term either way)
        return 34 * sbh / t if sp else sbh * (10 + 24 / t)
    return sbh / t * (34 + score) if sp else sbh * (10 + 24 / t + score / t)


def llama_layer_bytes(m: Dense, s: int, b: int, t: int = 1, sp: bool = False,
                      ac: str = "none", width: int = 2) -> float:
    """One Llama layer's saved tensors (``width`` bytes an element: 2 for bf16) on one of
    ``t`` tensor-parallel ranks, with sequence parallelism ``sp`` and checkpointing ``ac``."""
    _check(t, ac)
    sbh, sbf = s * b * m.hidden, s * b * m.ffn
    r = m.kv_heads / m.heads
    n = t if sp else 1  # sequence-sharded residual stream (and its norms) under SP
    lse = 4 * b * m.heads * s / t  # flash attention's fp32 log-sum-exp per head and token
    if ac == "full":
        return width * sbh / n  # the block's input
    if ac == "selective":
        return (width * sbh / n  # the block's input
                + width * sbh * (1 + 2 * r) / t  # q, k, v (matmul outputs)
                + width * sbh / t + lse  # attention's output
                + 2 * width * sbh  # o_proj and down_proj outputs: whole partial sums (TP)
                + 2 * width * sbf / t)  # gate and up outputs
    norms = 2 * (4 * sbh + 4 * s * b + width * sbh) / n  # fp32 input, rsqrt, normed input
    attention = (width * sbh  # input to q, k, v (gathered whole under SP)
                 + width * sbh * (1 + 2 * r) / t  # q, k (after rotary), v given to SDPA
                 + width * sbh / t + lse)  # its output (also o_proj's input)
    mlp = width * sbh + 4 * width * sbf / t  # input; gate, up, silu(gate), silu(gate) * up
    return norms + attention + mlp


def model_state_bytes(parameters: int, shards: int, param_bytes: int = 2,
                      grad_bytes: int | None = None, moments: int = 2) -> dict:
    """Per rank, ``parameters`` split over ``shards`` ranks (FSDP x TP). FSDP2 reduces
    gradients in fp32 but stores them in the parameter's dtype; AdamW keeps ``moments``
    states per parameter in the parameter's dtype (no fp32 master copy)."""
    p = parameters / shards
    grad = param_bytes if grad_bytes is None else grad_bytes
    return {"parameters": p * param_bytes, "gradients": p * grad,
            "optimizer_states": p * param_bytes * moments}


def megatron_state_bytes(parameters: int, dp: int, distributed_optimizer: bool = True) -> float:
    """Megatron's ``compute_weight_and_optimizer_memory`` per parameter (before TP / PP):
    bf16 weights + fp32 gradients (6 B) + fp32 master weights and Adam moments (12 B),
    the 12 B sharded over dp with the distributed optimizer."""
    return parameters * (6 + 12 / dp if distributed_optimizer else 18)


def training_flops(m: Dense, s: int, tokens: int, ac: str = "none", causal: bool = True,
                   flash_backward: bool = False, early_stop: bool = False) -> float:
    """FLOPs of forward and backward over ``tokens`` tokens of sequences of ``s``: 6 per
    matmul parameter and token, plus attention's 12 L h s per token (QK^T and AV, backward
    twice forward), half of it when causal. ``flash_backward``: count the score matrix
    that flash attention's backward recomputes (5 matmuls in backward, not 4: 14 L h s).
    ``ac="full"``: the blocks' forward runs again (the LM head is not checkpointed);
    ``early_stop``: torch's non-reentrant checkpoint stops recomputing once every saved
    tensor is back, so a block's last matmul (down_proj: its output is saved by nothing)
    is not rerun. Selective checkpointing (automodel's policy) keeps every matmul's and
    attention's output: it recomputes no FLOPs."""
    _check(1, ac)
    attn_fwd = 4 * m.layers * m.hidden * s * (0.5 if causal else 1.0)
    attn = attn_fwd * (3.5 if flash_backward else 3.0)
    total = 6 * m.matmul_parameters() + attn
    if ac == "full":
        rerun = m.layer_matmul_parameters() - (m.hidden * m.ffn if early_stop else 0)
        total += 2 * m.layers * rerun + attn_fwd
    return total * tokens
