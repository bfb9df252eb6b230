"""A training step reads values from the device to the host exactly once.

On a GPU every ``.item()``, ``float(t)``, ``int(t)``, ``.tolist()`` or Python branch on a tensor
makes the host wait until the GPU has caught up. CI has no GPU, so CUDA synchronizations cannot
be counted here; this instrumentation stands in for them: during the runner's real training
loop (``automodel.recipes.loop``), every such read of a tensor value on the host is counted,
per step, on CPU. Counted: ``Tensor.item``, ``tolist``, ``numpy``, ``__array__``, ``__float__``,
``__int__``, ``__index__``, ``__bool__``, ``__complex__`` (so also ``math.isfinite(t)``,
``if t:``, ``f"{t}"``) and ``Tensor.cpu`` of a tensor not already on the CPU.

What a step is here: everything the loop runs from ``Faults.before_step`` of one step to that of
the next (data, forward, backward, clipping, the loss, token count, non-finite policy, logging,
the stop-signal agreement), except the optimizer's own ``step()``: torch's AdamW reads its step
counters, which stay on the CPU unless ``capturable``/``fused``, so they are no device syncs.
Reads inside ``automodel/data`` are not counted: the data pipeline (reading rows, building
micro-batches, ahead in a background thread) only ever holds host tensors, which are copied
to the device after it. No checkpoints are written in these runs. Under a pipeline, torch's
schedule initializes its stages on its first call (``_initialize_stage``: a vote on static
or dynamic shapes, shape inference), reading a few values once; those reads are allowed in
the first step only.

Before (the step's token count, clipping and loss read one by one, the stop-signal agreement
and the peak memory read by themselves, transformers' packed-sequence check per forward), this
counted 12 reads per step in one process with 4 micro-batches, 10 with FSDP2 on 2 ranks with 2
micro-batches and 12 in a 2-stage 1F1B pipeline with 4 micro-batches.
"""

import functools
import traceback

import pytest
import torch

from tests.helpers import BASE, FP32, ON_CPU, run_on_ranks

READS = ("item", "tolist", "numpy", "__array__", "__float__", "__int__", "__index__", "__bool__",
         "__complex__")
STEPS = 3


class HostReads:
    """Counts host reads of tensor values while armed, per training step."""

    def __init__(self):
        self.armed = False
        self.steps: list[list[str]] = []  # per step: where each read came from
        self.one_time: list[list[str]] = []  # per step: reads of a pipeline's initialization
        self._saved: dict = {}

    def install(self):
        for name in READS + ("cpu",):
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._counting(name, original))
        return self

    def uninstall(self):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)

    def _counting(self, name, original):
        reads = self

        @functools.wraps(original)
        def wrapper(t, *args, **kwargs):
            if reads.armed and reads.steps and (name != "cpu" or t.device.type != "cpu"):
                reads.armed = False  # (formatting the stack must not count itself)
                try:
                    frames = traceback.extract_stack()[:-1]
                    where = " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}"
                                        for f in frames[-4:][::-1])
                    init = any(f.name == "_initialize_stage" and "pipelining" in f.filename
                               for f in frames)
                    # the data pipeline (automodel/data) handles only host tensors, before the
                    # batch is copied to the device: its reads are no device syncs
                    host_data = any("/automodel/data/" in f.filename for f in frames)
                    if not host_data:
                        (reads.one_time if init else reads.steps)[-1].append(
                            f"{name} at {where}")
                finally:
                    reads.armed = True
            return original(t, *args, **kwargs)

        return wrapper

    def start_step(self):
        self.steps.append([])
        self.one_time.append([])
        self.armed = True


def _instrument_runner(reads: HostReads):
    """Patch the runner's Faults (step boundaries) and Optimizers (not counted); returns an
    undo function."""
    import automodel.recipes.components as runner  # (where the runner builds them)

    saved = (runner.Faults, runner.Optimizers)

    class StepFaults(runner.Faults):
        def before_step(self, step):
            reads.armed = False
            super().before_step(step)
            reads.start_step()

    class UncountedOptimizers(runner.Optimizers):
        def step(self):
            armed, reads.armed = reads.armed, False
            try:
                super().step()
            finally:
                reads.armed = armed

    runner.Faults, runner.Optimizers = StepFaults, UncountedOptimizers

    def undo():
        runner.Faults, runner.Optimizers = saved

    return undo


def _run_counted(overrides, output_dir):
    """Train in this process (an initialized group, if any, is used); reads per step."""
    from automodel.api import load_config
    from automodel.distributed.init import init_distributed
    from automodel.recipes.train import train

    cfg = load_config(BASE + ON_CPU + [f"trainer.max_steps={STEPS}", "trainer.log_every=1"]
                      + list(overrides), str(output_dir))
    info = init_distributed(cfg.distributed.backend, cfg.distributed.timeout_minutes,
                            need_group=not cfg.strategy.one_process)
    reads = HostReads()
    undo = _instrument_runner(reads)
    reads.install()
    try:
        records = train(cfg, info)
    finally:
        reads.uninstall()
        undo()
    return records, reads


def _rank_counted(rank, world, overrides, output_dir):
    records, reads = _run_counted(overrides, output_dir)
    return records, reads.steps, reads.one_time


def _assert_one_read_per_step(records, per_step, one_time):
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # all logged
    assert len(per_step) == STEPS
    assert [len(s) for s in per_step] == [1] * STEPS, "host reads per step:\n" + "\n".join(
        f"step {i + 1}: {len(s)}\n    " + "\n    ".join(s) for i, s in enumerate(per_step))
    assert all(s[0].startswith("tolist at step_values.py:") for s in per_step), per_step
    assert not any(one_time[1:]), one_time  # a pipeline's initialization: first step only


@pytest.mark.fast  # one process, no process group
def test_one_host_read_per_step_single_process(tmp_path):
    records, reads = _run_counted(["parallelism=none", "trainer.local_batch_size=2"], tmp_path)
    _assert_one_read_per_step(records, reads.steps, reads.one_time)
    assert not any(reads.one_time)


@pytest.mark.fast  # one process, no process group
def test_skipped_nonfinite_step_reads_once_too(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOMODEL_FAULTS", "nan@2")
    records, reads = _run_counted(["parallelism=none", "trainer.on_nonfinite=skip"], tmp_path)
    _assert_one_read_per_step(records, reads.steps, reads.one_time)
    assert [bool(r.get("skipped")) for r in records] == [False, True, False]


@pytest.mark.parametrize("name,overrides", [
    ("fsdp2_accum", ["parallelism=fsdp2", FP32, "trainer.local_batch_size=2"]),
    ("pipeline_1f1b", ["parallelism=fsdp2", FP32, "pipeline.pp_microbatch_size=2",
                       "pipeline=1f1b"]),
])
def test_one_host_read_per_step_on_two_ranks(name, overrides, tmp_path):
    results = run_on_ranks(_rank_counted, 2, overrides, str(tmp_path / "out"),
                           tmp_path=tmp_path)
    for records, per_step, one_time in results:
        _assert_one_read_per_step(records, per_step, one_time)
    assert [r["loss"] for r in results[0][0]] == [r["loss"] for r in results[1][0]]
