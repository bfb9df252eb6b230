"""What three pipeline-related options do, observed directly (parity alone cannot tell an option
that does nothing from one that works):

- ``pipeline.pp_seq_len``: the stages are built with static shapes of that sequence length
  (this rank's share of it under context parallelism), the receive buffers have it, and the
  schedule's first step runs no shape-inference pass (torch's STATIC metadata mode);
- ``pipeline.patch_stage_backward_maybe_with_nosync``: with two schedule steps per optimizer
  step, FSDP2 reduce-scatters each unit's gradients once per optimizer step instead of once
  per schedule step;
- ``parallelism.defer_fsdp_grad_sync``: with gradient accumulation (no pipeline), one
  reduce-scatter per unit and step instead of one per micro-batch; under a pipeline it is not
  used (torch's schedule already reduces once per schedule step, whatever the micro-batch
  count), as ``docs/options.md`` says.

Reduce-scatters are counted by wrapping ``torch.distributed.reduce_scatter_single`` (what
FSDP2 calls) and ``reduce_scatter_tensor`` in the rank processes: real gloo collectives, only
counted. One optimizer step of the real step functions per configuration, all in one spawn of
4 gloo ranks (``run_on_ranks``), like ``test_mixed_precision.py``.
"""

import torch

from tests.helpers import BASE, FP32, run_on_ranks

HIDDEN = 64  # llama_tiny's hidden_size
SEQ = 32  # tests.helpers.TRAINER's seq_len
PP = ["parallelism=fsdp2", FP32, "pipeline=1f1b", "pipeline.pp_microbatch_size=1"]
PP_DP2 = PP + ["mesh.dp_size=2"]  # 8 sequences: 4 per dp rank
CONFIGS = {
    # 2 schedule steps of 2 micro-batches per optimizer step
    "two_schedule_steps": PP_DP2 + ["pipeline.pp_batch_size=2"],
    "two_schedule_steps_nosync": PP_DP2 + ["pipeline.pp_batch_size=2",
                                           "pipeline.patch_stage_backward_maybe_with_nosync=true"],
    # 1 schedule step of 4 micro-batches, FSDP's deferral on and off
    "pp_defer": PP_DP2 + ["parallelism.defer_fsdp_grad_sync=true"],
    "pp_no_defer": PP_DP2 + ["parallelism.defer_fsdp_grad_sync=false"],
    "pp_seq_len": PP_DP2 + [f"pipeline.pp_seq_len={SEQ}"],
    "pp_seq_len_cp2": PP + ["mesh.cp_size=2", f"pipeline.pp_seq_len={SEQ}"],
    # no pipeline: FSDP2 over 4 ranks, 2 micro-batches of 1 sequence per rank
    "accumulate_defer": ["parallelism=fsdp2", FP32, "trainer.local_batch_size=1",
                         "parallelism.defer_fsdp_grad_sync=true"],
    "accumulate_no_defer": ["parallelism=fsdp2", FP32, "trainer.local_batch_size=1",
                            "parallelism.defer_fsdp_grad_sync=false"],
}


class _Counts:
    """Counting wrappers around the reduce-scatter collectives and torch's stage metadata
    inference, installed once per process."""

    def __init__(self):
        import torch.distributed as dist
        from torch.distributed.pipelining.stage import PipelineStage

        self.reduce_scatters = 0
        self.shape_inferences = 0
        for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
            setattr(dist, name, self._counting(getattr(dist, name), "reduce_scatters"))
        PipelineStage._forward_metadata_inference = self._counting(
            PipelineStage._forward_metadata_inference, "shape_inferences")

    def _counting(self, fn, counter):
        def wrapper(*args, **kwargs):
            setattr(self, counter, getattr(self, counter) + 1)
            return fn(*args, **kwargs)

        return wrapper

    def reset(self):
        self.reduce_scatters = self.shape_inferences = 0


def _fsdp_units(parts) -> int:
    """FSDP2 parameter groups on this rank: each reduce-scatters its gradients as one."""
    from torch.distributed.fsdp import FSDPModule

    units = 0
    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                state = module._get_fsdp_state()
                groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
                units += sum(g is not None for g in groups)
    return units


def _shapes(metas):
    return None if metas is None else [tuple(m.shape) for m in metas]


def _stage_shapes(stages) -> dict:
    """Each stage's static (user-given) input and output shapes, read before the first step."""
    return {s.stage_index: {"inputs": _shapes(s._user_meta.inputs),
                            "outputs": _shapes(s._user_meta.outputs)} for s in stages}


def _after_step(stages) -> dict:
    """Each stage's metadata mode and the shapes of its first micro-batch's receive buffers."""
    out = {}
    for s in stages:
        recv = [] if s.is_first else [tuple(r.buffer.shape) for r in s.args_recv_info[0]]
        out[s.stage_index] = {"mode": s._inference_mode.name, "recv": recv}
    return out


def _one_step(rank, world, configs):
    """One optimizer step per configuration on these ranks: the reduce-scatters and shape
    inferences it ran, this rank's FSDP units, and its stages' shapes."""
    import warnings

    from automodel.api import load_config
    from automodel.compat import stages_of as _stages_of
    from automodel.data.batches import BatchPlan
    from automodel.data.sources import training_data
    from automodel.distributed.init import DistInfo
    from automodel.parallelize import parallelize
    from automodel.recipes import components
    from automodel.recipes import train as runner
    from automodel.recipes.pipeline_step import PipelineStep
    from automodel.recipes.router_loss import RouterLoss
    from automodel.recipes.step import train_step

    warnings.filterwarnings("ignore")
    counts = _Counts()
    results = {}
    for name, overrides in configs.items():
        cfg = load_config(BASE + [f"distributed.nproc_per_node={world}"] + overrides)
        info = DistInfo("gloo", torch.device("cpu"), rank, world, rank)
        setup = runner.build_setup(cfg, info)
        model, fill = components.initial_model(cfg, info)
        router_loss = RouterLoss.of(model)
        parallel = parallelize(model, setup, fill)
        t = cfg.trainer
        rows, _ = training_data(cfg.data_source, cfg.data, t.seq_len, cfg.model)
        batches = BatchPlan(rows, t.global_batch_size, t.seed).micro_batches(
            0, setup.dp_rank, setup.dp_size, t.local_batch_size)
        got = {"units": _fsdp_units(parallel.parts), "micro_batches": len(batches)}
        if setup.pp_enabled:
            step = PipelineStep(parallel, setup, t.global_batch_size // setup.dp_size,
                                router_loss)
            stages = _stages_of(step.schedule)
            got["static"] = _stage_shapes(stages)
            counts.reset()
            step(batches, cfg.optim.max_grad_norm)
            got.update(stages=_after_step(stages),
                       schedule_steps=sum(x.shape[0] for x, _ in batches) // step.batch)
        else:
            counts.reset()
            train_step(parallel.parts[0], setup, batches, cfg.optim.max_grad_norm,
                       router_loss, parallel.head_loss)
        got.update(reduce_scatters=counts.reduce_scatters,
                   shape_inferences=counts.shape_inferences)
        results[name] = got
    return results


def test_pipeline_options_change_collectives_and_shapes(tmp_path):
    ranks = run_on_ranks(_one_step, 4, CONFIGS, tmp_path=tmp_path)
    for rank, r in enumerate(ranks):
        _check_nosync(rank, r)
        _check_defer(rank, r)
        _check_pp_seq_len(rank, r)


def _check_nosync(rank, r):
    plain, nosync = r["two_schedule_steps"], r["two_schedule_steps_nosync"]
    units = plain["units"]
    assert units >= 2 and nosync["units"] == units, (rank, units)
    assert plain["schedule_steps"] == nosync["schedule_steps"] == 2
    # torch's schedule reduces each unit once per schedule step; the patch: once per step
    assert plain["reduce_scatters"] == 2 * units, (rank, plain)
    assert nosync["reduce_scatters"] == units, \
        (rank, "patch_stage_backward_maybe_with_nosync=true must reduce-scatter each FSDP unit "
         "once per optimizer step", nosync)


def _check_defer(rank, r):
    # without a pipeline: one reduce-scatter per unit and step deferred, one per micro-batch not
    defer, no_defer = r["accumulate_defer"], r["accumulate_no_defer"]
    assert defer["micro_batches"] == no_defer["micro_batches"] == 2
    assert defer["units"] == no_defer["units"] >= 2
    assert defer["reduce_scatters"] == defer["units"], (rank, defer)
    assert no_defer["reduce_scatters"] == 2 * no_defer["units"], (rank, no_defer)
    # under a pipeline the option is not used: 4 micro-batches in one schedule step reduce
    # each unit once either way
    on, off = r["pp_defer"], r["pp_no_defer"]
    assert on["schedule_steps"] == off["schedule_steps"] == 1
    assert on["reduce_scatters"] == off["reduce_scatters"] == on["units"], (rank, on, off)


def _check_pp_seq_len(rank, r):
    pp_rank = rank // 2  # (pp is the outermost mesh axis)
    for name, seq in (("pp_seq_len", SEQ), ("pp_seq_len_cp2", SEQ // 2)):
        got = r[name]
        [(stage, static)] = got["static"].items()
        assert stage == pp_rank
        # a micro-batch of one sequence; under context parallelism this rank's share of it
        between = (1, seq, HIDDEN)
        if stage == 0:
            assert static["inputs"] == [(1, seq)], (name, rank, static)  # the token ids
            assert static["outputs"] == [between], (name, rank, static)
        else:  # (trainer.loss=auto fuses the head with the loss: hidden states out)
            assert static["inputs"] == static["outputs"] == [between], (name, rank, static)
        after = got["stages"][stage]
        assert after["mode"] == "STATIC", (name, rank, after)
        assert after["recv"] == ([] if stage == 0 else [between]), (name, rank, after)
        assert got["shape_inferences"] == 0, (name, rank, got)
    # the contrast: without pp_seq_len no shapes are given and the first step infers them
    inferred = r["pp_defer"]
    assert inferred["static"][pp_rank] == {"inputs": None, "outputs": None}
    assert inferred["stages"][pp_rank]["mode"] == "DYNAMIC"
    assert inferred["shape_inferences"] == 1, (rank, inferred)
    assert inferred["stages"][pp_rank]["recv"] == r["pp_seq_len"]["stages"][pp_rank]["recv"]
