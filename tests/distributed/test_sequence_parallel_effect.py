"""What ``parallelism.sequence_parallel`` and ``parallelism.enable_async_tensor_parallel`` do
to a model, observed on it (issue 24): loss parity alone cannot tell a working option from a
no-op, since plain TP matches one process too.

One spawn of two gloo ranks builds llama_tiny three times through the runner's own path
(``load_config`` -> ``build_setup`` -> ``parallelize``: TP2 over FSDP2) -- plain TP, TP with
sequence parallelism, and TP with async TP -- and forward hooks record what enters and leaves
the decoder blocks, the norms and the first projection of each TP region.
"""

import logging
import math

import pytest

from tests.helpers import FP32, run_on_ranks

BATCH, SEQ = 2, 16
BASE = ["parallelism=fsdp2", FP32, "mesh.tp_size=2", "distributed.nproc_per_node=2",
        "distributed.backend=gloo"]  # (gloo ranks on the CPU, also on a machine with GPUs)
LAYOUTS = {
    "tp": BASE,
    "tp_sp": BASE + ["parallelism.sequence_parallel=true"],
    "tp_async": BASE + ["parallelism.enable_async_tensor_parallel=true"],
}


def _describe(x):
    """(placements or None for a plain tensor, local shape, global shape)."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, (tuple, list)):
        x = x[0]
    if isinstance(x, DTensor):
        return (tuple(str(p) for p in x.placements), tuple(x.to_local().shape), tuple(x.shape))
    return None, tuple(x.shape), tuple(x.shape)


def _record(model, seen):
    """Forward hooks (registered after ``parallelize``, so they see what the modules see)."""
    def pre(key):
        def hook(module, args, kwargs):
            seen.setdefault(key, []).append(
                _describe(args[0] if args else kwargs["hidden_states"]))
        return hook

    def post(key):
        def hook(module, args, output):
            seen.setdefault(key, []).append(_describe(output))
        return hook

    inner = model.model
    inner.embed_tokens.register_forward_hook(post("embedding_out"))
    inner.norm.register_forward_pre_hook(pre("norm_in"), with_kwargs=True)
    for layer in inner.layers:
        layer.register_forward_pre_hook(pre("block_in"), with_kwargs=True)
        layer.register_forward_hook(post("block_out"))
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.register_forward_pre_hook(pre("norm_in"), with_kwargs=True)
        # the first projection inside each TP region (after the region's own entry hooks)
        for proj in (layer.self_attn.q_proj, layer.mlp.gate_proj):
            proj.register_forward_pre_hook(pre("region_in"), with_kwargs=True)


def _batch(cfg):
    import torch

    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.model.config["vocab_size"], (BATCH, SEQ), generator=gen)
    return x, x.roll(-1, dims=1)


def _grad_norm(grads) -> float:
    return math.sqrt(sum(g.double().pow(2).sum().item() for g in grads))


def _one_process(cfg):
    """The same weights, batch and loss in one process, without any parallelism."""
    import torch

    from automodel.loss import summed_cross_entropy
    from automodel.models.builder import build_model

    model = build_model(cfg.model, cfg.trainer.seed)
    x, y = _batch(cfg)
    out = model(input_ids=x, position_ids=torch.arange(SEQ).expand_as(x), use_cache=False)
    loss = summed_cross_entropy(out.logits, y)
    loss.backward()
    return {"loss": loss.item(), "grad_norm": _grad_norm(p.grad for p in model.parameters())}


def _build_and_step(rank, world, cfg):
    import torch
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import is_symm_mem_enabled_for_group

    from automodel.distributed.init import DistInfo
    from automodel.distributed.mesh import MeshAxis
    from automodel.parallelize import parallelize
    from automodel.recipes.components import initial_model
    from automodel.recipes.step import device_batches, forward_loss
    from automodel.recipes.train import build_setup

    inductor_config._micro_pipeline_tp = False  # (a fresh value for each layout)
    info = DistInfo("gloo", torch.device("cpu"), rank, world, rank)  # (CPU, whatever the box)
    setup = build_setup(cfg, info)
    model, fill = initial_model(cfg, info)
    parallel = parallelize(model, setup, fill)
    part = parallel.parts[0]
    tp_group = setup.mesh[MeshAxis.TP].get_group().group_name
    seen = {"micro_pipeline_tp": inductor_config._micro_pipeline_tp,
            "symm_mem": is_symm_mem_enabled_for_group(tp_group)}
    _record(part, seen)
    x, y = _batch(cfg)
    batch = device_batches([(x, y)], setup)[0]
    _, loss = forward_loss(part, setup, batch, head_loss=parallel.head_loss)
    loss.backward()
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
             for p in part.parameters()]
    seen["loss"] = loss.item()
    seen["grad_norm"] = _grad_norm(grads)
    return seen


def _observe(rank, world, cfgs):
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger("automodel").addHandler(Keep(level=logging.WARNING))
    seen = {"one_process": _one_process(cfgs["tp"])}
    for name, cfg in cfgs.items():
        seen[name] = _build_and_step(rank, world, cfg)
        seen[name]["log"], lines[:] = list(lines), []
    return seen


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """Per rank, per layout: what the hooks saw, and the warnings (config time: "config_log";
    the ranks: "log")."""
    from automodel.api import load_config

    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    keep = Keep(level=logging.WARNING)
    logger = logging.getLogger("automodel")
    logger.addHandler(keep)
    # (module scope comes before conftest's _no_gpus: the same CPU-machine probe, here)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("automodel.config.launch_env.gpu_device_probe", lambda: 0)
        try:
            cfgs, config_logs = {}, {}
            for name, overrides in LAYOUTS.items():
                cfgs[name] = load_config(overrides, env={})
                config_logs[name], lines[:] = "\n".join(lines), []
        finally:
            logger.removeHandler(keep)
    per_rank = run_on_ranks(_observe, 2, cfgs, tmp_path=tmp_path_factory.mktemp("sp_effect"))
    for seen in per_rank:
        for name, cfg in cfgs.items():
            seen[name]["config_log"] = config_logs[name]
            seen[name]["resolved_sequence_parallel"] = cfg.parallelism.sequence_parallel
    return per_rank


HIDDEN = 64  # llama_tiny
FULL = (BATCH, SEQ, HIDDEN)
HALF = (BATCH, SEQ // 2, HIDDEN)
N_LAYERS, N_NORMS = 4, 2 * 4 + 1


def test_plain_tp_keeps_the_whole_sequence_between_regions(observed):
    """Without sequence parallelism every rank holds the whole sequence everywhere: plain
    (replicated) tensors at the block boundaries and norms."""
    for seen in observed:
        tp = seen["tp"]
        assert not tp["resolved_sequence_parallel"]
        assert tp["embedding_out"] == [(None, FULL, FULL)]
        assert tp["block_in"] == tp["block_out"] == [(None, FULL, FULL)] * N_LAYERS
        assert tp["norm_in"] == [(None, FULL, FULL)] * N_NORMS
        assert tp["region_in"] == [(("R",), FULL, FULL)] * (2 * N_LAYERS)


@pytest.mark.parametrize("layout", ["tp_sp", "tp_async"])
def test_sequence_parallel_shards_the_sequence_between_regions(observed, layout):
    """With sequence parallelism the residual stream between TP regions is a DTensor sharded
    on the sequence (``Shard(1)``): each rank holds half the tokens at every block boundary
    and runs the norms on them; each attention/MLP region gathers the whole sequence on
    entry. Async TP turns sequence parallelism on (``resolve_sequence_parallel``)."""
    sharded = (("S(1)",), HALF, FULL)
    for seen in observed:
        sp = seen[layout]
        assert sp["resolved_sequence_parallel"]
        assert sp["embedding_out"] == [sharded]
        assert sp["block_in"] == sp["block_out"] == [sharded] * N_LAYERS
        assert sp["norm_in"] == [sharded] * N_NORMS
        assert sp["region_in"] == [(("R",), FULL, FULL)] * (2 * N_LAYERS)


def test_every_layout_keeps_the_numbers_of_one_process(observed):
    """Same weights, same batch: the loss and gradient norm of one process (fp32)."""
    for seen in observed:
        want = seen["one_process"]
        for layout in LAYOUTS:
            assert seen[layout]["loss"] == pytest.approx(want["loss"], rel=1e-5)
            assert seen[layout]["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)


def test_async_tp_on_cpu_turns_on_inductor_micro_pipelining_and_says_it_cannot_overlap(
        observed):
    """On CPU, async TP: (1) turns sequence parallelism on, with a warning at config time
    (its activations are checked above); (2) sets inductor's ``_micro_pipeline_tp``, the
    post-grad pass that fuses all-gather/reduce-scatter with matmuls in compiled code; (3)
    enables no symmetric memory for the TP group (CUDA only; without it that pass leaves the
    graph as it is), and a warning on the ranks says so. Plain TP and SP do none of this."""
    for seen in observed:
        on = seen["tp_async"]
        assert on["micro_pipeline_tp"] is True and on["symm_mem"] is False
        assert "requires sequence parallelism: setting parallelism.sequence_parallel=true" in \
            on["config_log"]
        assert any("only happens on CUDA" in line for line in on["log"])
        for layout in ("tp", "tp_sp"):
            off = seen[layout]
            assert off["micro_pipeline_tp"] is False and off["symm_mem"] is False
            assert "enable_async_tensor_parallel" not in off["config_log"]
            assert not any("async tensor parallel" in line for line in off["log"])
