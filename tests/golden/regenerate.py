"""Golden values: losses, gradient norms and learning rates of a few canonical fp32 CPU runs,
stored in ``tests/golden/<name>.json`` and checked by ``tests/distributed/test_golden.py``.

Parity tests compare a layout with a single-process run made by the same code, so a bug that
moves both (the loss, the data, the optimizer, the LR schedule, the model) passes them; these
stored numbers catch it.

Regenerate (only for a deliberate change of numerics, e.g. a torch or transformers upgrade, a
new data generator; say so and why in the commit message)::

    .venv/bin/python -m tests.golden.regenerate            # every run
    .venv/bin/python -m tests.golden.regenerate fsdp2_dp2  # some of them
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from tests.helpers import BASE, FP32

GOLDEN_DIR = Path(__file__).resolve().parent
KEYS = ("step", "loss", "grad_norm", "lr")
OPTIONAL_KEYS = ("aux_loss",)  # a MoE run's router loss

# name -> (base overrides, overrides). Run through tests.helpers.train, i.e. as the CLI would.
RUNS = {
    # (a) the single-process reference every parity test compares with (tests/conftest.py)
    "single_process": (BASE, ["parallelism=none"]),
    # (b) FSDP2 on 2 ranks, fp32 parameters and reductions
    "fsdp2_dp2": (BASE, ["parallelism=fsdp2", FP32]),
    # (c) a 2-stage 1F1B pipeline, 4 micro-batches (as in test_pipeline.PP)
    "pipeline_1f1b": (BASE, ["parallelism=fsdp2", FP32, "pipeline.pp_microbatch_size=2",
                             "pipeline=1f1b"]),
    # (d) `python train.py` as is (FSDP2 on 2 ranks, bf16 parameters), first 5 of its 300
    # steps: stop_at_step keeps the 300-step LR schedule that max_steps=5 would change.
    "default_job": ([], ["trainer.stop_at_step=5", "trainer.log_every=1"]),
    # The runs below are checked where a parity test already runs exactly that job (the test
    # named); tests/distributed/test_golden.py checks that the overrides there are these.
    # (e) DDP on 2 ranks (test_parity.py, "ddp")
    "ddp_dp2": (BASE, ["parallelism=ddp"]),
    # (f) TP 2 with sequence parallelism (test_tensor_parallel.py, "tp2_sequence_parallel")
    "tp2_sequence_parallel": (BASE, ["parallelism=fsdp2", FP32, "mesh.tp_size=2",
                                     "parallelism.sequence_parallel=true"]),
    # (g) context parallelism, a ring of 2, 2 micro-batches (test_context_parallel.py, "cp2_ring")
    "cp2_ring": (BASE, ["parallelism=fsdp2", FP32, "mesh.cp_size=2",
                        "trainer.local_batch_size=2"]),
    # (h) a tiny MoE, experts over ep 2, router loss on (test_moe.py, "ep2" x qwen3_moe_tiny)
    "moe_ep2": (BASE, ["parallelism=fsdp2", FP32, "mesh.dp_size=2", "mesh.ep_size=2",
                       "model=qwen3_moe_tiny"]),
    # (i) image-text: tiny LLaVA, frozen vision tower (test_image_text.py, frozen "root")
    "image_text_dp2": (BASE, ["parallelism=fsdp2", FP32, "mesh.dp_size=2", "model=llava_tiny",
                              "model.freeze=[vision]",
                              "parallelism.multimodal.frozen_sharding=root",
                              "trainer.local_batch_size=2"]),
}


def golden_path(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.json"


def summarize(records: list[dict]) -> list[dict]:
    return [{k: r[k] for k in KEYS + OPTIONAL_KEYS if k in KEYS or k in r} for r in records]


def environment() -> dict:
    """What the numbers depend on besides the code: versions, and the CPU kernels torch picks."""
    import platform

    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def run_golden(name: str, output_dir) -> list[dict]:
    """Run one canonical job; its records reduced to step, loss, grad_norm, lr."""
    from tests.helpers import train

    base, overrides = RUNS[name]
    return summarize(train(overrides, output_dir, base=base))


def load_golden(name: str) -> dict:
    with open(golden_path(name), encoding="utf-8") as f:
        return json.load(f)


def write_golden(name: str, records: list[dict]) -> Path:
    base, overrides = RUNS[name]
    data = {"overrides": list(base) + list(overrides), "generated_with": environment(),
            "records": records}
    # one record per line: a regeneration shows in a diff as the steps that moved
    text = json.dumps(data, indent=1).split('"records": [')[0] + '"records": [\n' + \
        ",\n".join("  " + json.dumps(r) for r in records) + "\n ]\n}\n"
    assert json.loads(text) == data
    path = golden_path(name)
    path.write_text(text, encoding="utf-8")
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.golden.regenerate",
                                     description="Rerun the canonical jobs and rewrite "
                                                 "tests/golden/*.json.")
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"runs to regenerate (default: all): {', '.join(RUNS)}")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in RUNS]
    if unknown:
        parser.error(f"unknown run(s) {', '.join(unknown)}; choose from {', '.join(RUNS)}")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for name in args.names or list(RUNS):
        with tempfile.TemporaryDirectory(prefix=f"golden-{name}-") as out:
            records = run_golden(name, out)
        path = write_golden(name, records)
        print(f"{path}: " + ", ".join(f"{r['loss']:.6f}" for r in records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
