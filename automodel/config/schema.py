"""Structured-config schemas. Pure dataclasses: no torch, no YAML.

Hydra validates composed configs against these (see ``store.py``); ``resolve.py`` turns the
composed config into instances of them and checks what spans fields. Field names, types and
defaults are documented in ``docs/options.md``. Fields whose values are a union Hydra cannot
express (``bool | "full" | "selective"``, ``"all" | list``, ``_target_`` policies) are ``Any``
here and are checked in ``resolve.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from automodel.config.enums import (
    AsyncMode,
    FrozenSharding,
    LoraInit,
    Loss,
    OnNonfinite,
    PeftMethod,
    VisionTP,
    VisionUnit,
    WandbMode,
)


# --------------------------------------------------------------------------- runtime / mesh
@dataclass
class DistributedConfig:
    """Process-group init and local launch."""

    backend: Optional[str] = None  # null = nccl with CUDA, else gloo
    timeout_minutes: float = 1  # collective timeout during training, every mesh sub-group too
    startup_timeout_minutes: float = 30  # the same until the first step ends, and around what
    # rank 0 does alone (checkpoint save and export, W&B start and finish)
    nproc_per_node: Optional[int] = None  # null = product of mesh sizes (2 for DP strategies)
    # before launch, one training step of each pipeline rank on fake tensors (the model cut to
    # a layer per stage) for layouts with tp, cp, pp or ep: a layout that would crash is refused
    preflight_step: bool = True
    stop_grace_seconds: int = 120  # after SIGTERM the local launcher gives its ranks this long
    # to finish the step and save a checkpoint before killing them (torchrun: set
    # TORCH_ELASTIC_SHUTDOWN_TIMEOUT; SLURM: the job's signal delay)
    # when a rank fails: stop every rank and start them again, resuming from the last complete
    # checkpoint, up to this many times in the job (0: the job fails at once)
    max_restarts: int = 0


@dataclass
class MeshConfig:
    """Parallel degrees. ``null`` sizes are inferred by ``resolve.py``."""

    dp_size: Optional[int] = None  # null = world / (tp * cp * pp)
    dp_replicate_size: Optional[int] = None  # HSDP replication degree; null = 1
    tp_size: int = 1
    cp_size: int = 1
    cp_ulysses_size: Optional[int] = None  # null = the whole cp axis is ring
    pp_size: Optional[int] = None  # null = 2 when a pipeline schedule is chosen, else 1
    ep_size: int = 1


# --------------------------------------------------------------------------- strategies
@dataclass
class CommonOptions:
    """Options every strategy except Megatron-FSDP shares."""

    activation_checkpointing: Any = False  # bool | "full" | "selective"
    activation_checkpointing_scope: Any = "all"  # "all" | list of language/vision/audio/multimodal
    autocast_dtype: Optional[str] = None  # e.g. bfloat16: forward under torch.autocast
    enable_compile: bool = False  # per-layer torch.compile of decoder layers
    patch_is_packed_sequence: bool = False
    # pkg.module.fn called with each model part after the pipeline split, before TP/FSDP
    pre_shard_hook: Optional[str] = None


@dataclass
class SingleProcessConfig(CommonOptions):
    """``parallelism=none``: one process, no wrapping. The reference for loss parity."""


@dataclass
class DDPConfig(CommonOptions):
    """``parallelism=ddp``: torch DistributedDataParallel over the data-parallel axis."""

    broadcast_buffers: bool = False
    bucket_cap_mb: Optional[float] = None  # null = PyTorch's default
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False


@dataclass
class VisionConfig:
    """``parallelism.multimodal.vision``: how FSDP2 shards an image-text model's vision tower
    (its blocks that are sharded at all: trainable ones, or frozen ones under ``per_layer``)."""

    unit: VisionUnit = VisionUnit.layer  # layer: each tower block its own unit | tower: the
    # tower one unit
    reshard_after_forward: Optional[bool] = None  # null = as the language blocks
    tp: VisionTP = VisionTP.whole  # under mesh.tp_size > 1: whole | heads (split by heads)


@dataclass
class MultimodalConfig:
    frozen_sharding: FrozenSharding = FrozenSharding.root  # root | per_layer | replicate
    vision: VisionConfig = field(default_factory=VisionConfig)


@dataclass
class MoEConfig:
    """``parallelism.moe``: the experts' own FSDP2 units under expert parallelism."""

    shard_experts: bool = True  # FSDP-shard each ep rank's experts over ep_shard
    reshard_after_forward: Optional[bool] = None  # null = as the experts' block


@dataclass
class FSDP2Config(CommonOptions):
    """``parallelism=fsdp2`` (HSDP when ``mesh.dp_replicate_size`` > 1)."""

    sequence_parallel: bool = False
    tp_plan: Any = None  # null | dict pattern -> style | import path
    enable_async_tensor_parallel: bool = False
    enable_fsdp2_prefetch: bool = True
    fsdp2_forward_prefetch_depth: int = 1
    fsdp2_backward_prefetch_depth: int = 2
    reshard_after_forward: Optional[bool] = None  # null = heuristic
    defer_fsdp_grad_sync: bool = True
    mp_policy: Any = None  # {_target_: torch.distributed.fsdp.MixedPrecisionPolicy, ...} | null
    offload_policy: Any = None  # {_target_: torch.distributed.fsdp.CPUOffloadPolicy, ...} | null
    multimodal: MultimodalConfig = field(default_factory=MultimodalConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)


@dataclass
class HSDPConfig(FSDP2Config):
    """``parallelism=hsdp``: FSDP2 on a replicate x shard mesh (its option file sets
    ``mesh.dp_replicate_size: 2``); every FSDP2 option applies."""


@dataclass
class MegatronFSDPConfig:
    """``parallelism=megatron_fsdp`` (the ``megatron-fsdp`` package; CUDA only)."""

    zero_dp_strategy: Any = 3  # int 0-3 or no_shard | optim | optim_grads | optim_grads_params
    megatron_fsdp_unit_modules: Optional[List[str]] = None
    activation_checkpointing: bool = False
    autocast_dtype: Optional[str] = None
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    grad_reduce_in_fp32: bool = False
    preserve_fp32_weights: bool = False
    init_fsdp_with_meta_device: bool = False
    average_in_collective: bool = False
    calculate_per_token_loss: bool = False
    disable_bucketing: bool = False
    fsdp_double_buffer: bool = False
    nccl_ub: bool = False
    keep_fp8_transpose_cache: bool = False
    check_for_nan_in_grad: bool = True
    report_nan_in_param_grad: bool = False
    sequence_parallel: bool = False
    tp_plan: Any = None
    patch_is_packed_sequence: bool = False


# --------------------------------------------------------------------------- pipeline
@dataclass
class PipelineConfig:
    """``pipeline=<schedule>``. ``pipeline=none`` leaves the node empty."""

    pp_schedule: str = "1f1b"
    pp_schedule_csv: Optional[str] = None
    pp_batch_size: Optional[int] = None  # null = the per-dp-rank batch
    pp_microbatch_size: int = 1
    layers_per_stage: Optional[int] = None
    round_virtual_stages_to_pp_multiple: Optional[str] = None  # up | down | null
    module_fqns_per_model_part: Optional[List[List[str]]] = None
    pp_seq_len: Optional[int] = None  # null = trainer.seq_len
    dtype: Optional[str] = None
    scale_grads_in_schedule: bool = False
    loss_fn: Optional[str] = None  # import path; null = the recipe's own loss
    patch_causal_lm_model: bool = True
    patch_inner_model: bool = True
    patch_stage_backward_maybe_with_nosync: bool = False
    pp_recv_buffer_pool: bool = False
    pp_recv_buffer_pool_slack: int = 2


# --------------------------------------------------------------------------- model, data, optim
@dataclass
class ModelConfig:
    name: str = "llama_tiny"
    # keyword arguments of ``AutoConfig.for_model``; ``model_type`` selects the family
    config: Dict[str, Any] = field(default_factory=dict)
    pretrained_path: Optional[str] = None  # local directory for ``from_pretrained``
    dtype: str = "float32"
    # layer groups (vision, multimodal, language, audio) or parameter-name patterns to freeze
    freeze: List[str] = field(default_factory=list)


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning (the ``peft`` group): adapters beside frozen weights."""

    method: PeftMethod = PeftMethod.none  # none | lora | qlora (set by the group's file)
    rank: int = 8  # r: the adapters' inner width
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input
    # module-name patterns (fnmatch: *.q_proj), or [all-linear]; null: the attention and MLP
    # projections of the language model's blocks
    target_modules: Optional[List[str]] = None
    exclude_modules: List[str] = field(default_factory=list)  # patterns taken out again
    lora_dtype: str = "float32"  # the adapters' storage dtype
    # the frozen base's storage dtype (it takes no optimizer step: no float32 master copy
    # needed); null: the compute dtype (the mp_policy's param_dtype, else
    # parallelism.autocast_dtype, else model.dtype): bfloat16 under the default policy
    base_dtype: Optional[str] = None
    init_lora_weights: LoraInit = LoraInit.kaiming  # how A starts (B starts at zero)
    use_dora: bool = False  # DoRA: a trained length per output row (lora_magnitude_vector)
    experts: bool = False  # adapters on every expert of the MoE layers' fused 3-D weights
    # qlora: the adapted layers' weights in NF4, one scale per block of this many values, the
    # scales themselves quantized in groups of this many blocks
    nf4_block_size: int = 64
    nf4_scaler_block_size: int = 256


@dataclass
class CorpusDataConfig:
    """The shipped procedural language, byte-level tokens."""

    num_documents: int = 20000
    seed: int = 0
    image_every: int = 1  # image-text models: every n-th sample has an image (0: none)
    pack_boundaries: bool = False  # attention and positions restart at each document
    eval_fraction: float = 0.0  # the last fraction of the rows, held out for evaluation


@dataclass
class SyntheticDataConfig:
    """Uniform random tokens from a seed (tests)."""

    num_sequences: int = 4096
    vocab_size: Optional[int] = None  # null = the model's vocabulary
    seed: int = 0
    image_every: int = 1  # image-text models: every n-th sample has an image (0: none)
    eval_fraction: float = 0.0


@dataclass
class FilesDataConfig:
    """Local ``.txt`` (one document per blank-line-separated block) or ``.jsonl`` files."""

    paths: List[str] = field(default_factory=list)
    text_key: str = "text"
    tokenizer_path: Optional[str] = None  # local directory for ``AutoTokenizer``; null = bytes
    # (an image-text model: its processor's directory; null = model.pretrained_path)
    image_key: str = "image"  # image-text models: a .jsonl record's image path(s)
    pack_boundaries: bool = False
    eval_fraction: float = 0.0


@dataclass
class HFDataConfig:
    """A local Hugging Face dataset: a ``save_to_disk`` folder, or parquet / JSON lines /
    arrow / CSV files; tokenized once into a memory-mapped cache (``data/token_cache.py``)."""

    path: Optional[str] = None  # required
    split: str = "train"
    text_field: str = "text"
    template: Optional[str] = None  # "{instruction}\n{response}": record fields, not text_field
    # auto (from the first record) | text (text_field / template) | chat (messages_field,
    # through the tokenizer's chat template) | prompt_completion (prompt_field +
    # completion_field)
    format: str = "auto"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    train_on: str = "all"  # all | completion: labels only on assistant turns / the completion
    tokenizer_path: Optional[str] = None  # local directory for ``AutoTokenizer``; null = bytes
    cache_dir: Optional[str] = None  # null = $AUTOMODEL_CACHE, else ~/.cache/automodel
    pack_boundaries: bool = False
    eval_fraction: float = 0.0
    eval_split: Optional[str] = None  # a split of its own for evaluation (else eval_fraction)


@dataclass
class TokensDataConfig:
    """Pre-tokenized: a ``.npy`` array of token ids (and of document start offsets), or a
    token-cache folder; memory-mapped."""

    path: Optional[str] = None  # required
    doc_starts_path: Optional[str] = None  # null = one document
    cache_dir: Optional[str] = None  # where the one-time scan of the arrays is remembered
    pack_boundaries: bool = False
    eval_fraction: float = 0.0


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 3.0e-3
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1.0e-8
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at max_steps
    max_grad_norm: Optional[float] = 1.0  # null = no clipping (the norm is still logged)
    # AdamW's multi-tensor path: true = a group's tensors updated together (fast; temporaries
    # the size of a state) | false = one parameter at a time | null = torch's choice (true on
    # a GPU, false on the CPU)
    foreach: Optional[bool] = None


@dataclass
class CheckpointConfig:
    every_steps: Optional[int] = None  # null = no checkpoints
    dir: Optional[str] = None  # null = <output dir>/checkpoints
    keep_last: Optional[int] = 3  # null = keep all
    resume: Optional[str] = None  # null | auto (latest complete in dir) | a checkpoint path
    # also write checkpoints as Hugging Face models in <checkpoint>/hf (safetensors; loadable
    # by from_pretrained): never | final (the checkpoint of trainer.max_steps) | every (true
    # and false: every and never)
    export_hf: str = "never"
    export_dtype: Optional[str] = None  # the export's weights: float32 | bfloat16 | float16;
    # null: the model's source dtype (a pretrained model's stored dtype, else model.dtype)
    export_max_shard_size: str = "5GB"  # the export's largest safetensors file (5GB, 500MB)
    last_save_model_only: bool = False  # the checkpoint of trainer.max_steps without optimizer
    # what a load leaves out, of: optimizer, scheduler (the LR schedule), step (the step
    # counter and the data position: the run starts at step 0), rng
    exclude_from_loading: List[str] = field(default_factory=list)
    initial_load_path: Optional[str] = None  # a checkpoint (step_<N>, any layout) whose
    # weights a fresh run starts from instead of model.pretrained_path's (a resumed run
    # loads its own checkpoint)
    # none: a save blocks until written | thread / process: training waits only while the
    # state is copied to host memory; the write, then the checkpoint's completion, go on in
    # the background (one save at a time; the last save of a run blocks)
    async_mode: AsyncMode = AsyncMode.none
    pinned_memory: bool = False  # async saves copy the state into pinned host memory (GPUs)
    # how long a save's collectives wait for the slowest rank: a blocking save with its export,
    # and the whole background write of an async save (its group keeps this timeout)
    save_timeout_minutes: float = 30


@dataclass
class TrainerConfig:
    max_steps: int = 100
    global_batch_size: int = 16
    local_batch_size: Optional[int] = None  # micro-batch per dp rank; null = global / dp
    seq_len: int = 64
    seed: int = 1234
    log_every: int = 10
    stop_at_step: Optional[int] = None  # end this run after this step (the schedule still
    # spans max_steps); for splitting a run into time slots
    # a NaN/inf loss or gradient norm: raise (stop) | skip the step
    on_nonfinite: OnNonfinite = OnNonfinite["raise"]
    eval_every: int = 0  # evaluate on the held-out rows every n steps (and at the end); 0: never
    eval_batches: Optional[int] = None  # global batches per evaluation; null = all held out
    prefetch_steps: int = 1  # steps of micro-batches read ahead in a background thread; 0: none
    loss: Loss = Loss.auto  # fused: the LM head and the loss together, chunked | plain | auto
    loss_chunk_tokens: int = 1024  # tokens per chunk of the fused loss
    profile_steps: Optional[List[int]] = None  # [first, last]: torch.profiler over those steps
    # peak_tensor_bytes in metrics.jsonl (each rank's peak of live tensor bytes per step): null =
    # on a GPU (the CUDA allocator's count, free) | true = on the CPU too (a dispatch mode
    # counting storages: a few microseconds per operator) | false = never
    track_tensor_memory: Optional[bool] = None
    # after this many steps, compare the run with its plan (plan.json, made before any rank
    # starts): step time, peak per rank class, bytes per mesh axis, in train.log and
    # plan_check.json (docs/planning.md, "The plan beside the run"); null = 10 under
    # layout=auto, else off | 0 = off | N >= 3 (the first step warms up, the second counts bytes)
    plan_check_steps: Optional[int] = None


# --------------------------------------------------------------------------- tracking
@dataclass
class WandbConfig:
    """Weights & Biases, from rank 0 only. ``mode: offline`` needs no network.

    When ``project``, ``entity``, ``mode`` or ``dir`` is null, W&B's own environment variable
    applies (WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE, WANDB_DIR); a value set here wins.
    """

    project: Optional[str] = None  # null = $WANDB_PROJECT, else "automodel"
    entity: Optional[str] = None  # null = $WANDB_ENTITY, else the account's default entity
    mode: Optional[WandbMode] = None  # online | offline | disabled; null = $WANDB_MODE, else
    # online
    group: Optional[str] = None  # null = the sweep's directory name in a multirun
    job_type: str = "train"
    name: Optional[str] = None  # null = the output directory's name
    tags: List[str] = field(default_factory=list)  # added to the group:option tags
    id: Optional[str] = None  # null = stable per output directory / SLURM job (requeue resumes)
    dir: Optional[str] = None  # null = $WANDB_DIR, else the run's output directory


@dataclass
class LoggerConfig:
    wandb: Optional[WandbConfig] = None
