"""Every causal-LM family of the installed transformers, in every layout: the table of issue 37.

For each ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING`` the family's default config is
shrunk to a tiny one (the size keys it has, set small; dropouts 0; per-layer lists cut), the
model is built on the host with a fixed seed and saved, and then trained as a user would
(``model=pretrained model.pretrained_path=DIR``, ``automodel.api.run``: the whole preflight,
then the ranks) in one process and under each layout, fp32, a few steps; ``bf16`` is FSDP2
under the default ``mp_policy`` (bfloat16 weights), against the same float32 process at a
bfloat16 tolerance (rtol 2e-2 in the loss, 1e-1 in the gradient norm). A row says per layout:

- ``works``: losses and gradient norms match the single process (rtol 1e-5 and 1e-4);
- ``refused: ...``: refused before launch (a ``ConfigError``), with the first words of why;
- ``rounding: ...``: off by more, and matches when rerun (with its reference) at
  ``optim.eps=1e-4``: AdamW divides each gradient element by its own size (plus ``eps``), so
  an element near zero moves by up to the learning rate on float32 rounding alone (the order
  in which a layout sums); a larger ``eps`` damps those elements, not a wrong gradient's;
- ``drifts: ...`` (``bf16`` only): the first step is within bfloat16's tolerance (the
  losses, and the gradient norm to 2e-2), later gradient norms are not: the two precisions'
  trajectories part (a run near an instability at this learning rate), not a wrong step;
- ``FAILS: ...``: it launched and crashed, or trained and did not match.

Families that cannot be built tiny from their default config (another kind of model, a
package missing, a config the shrinking breaks, a tiny model that does not train in one
process either) get one row saying why; so does a family slower than ``--seconds`` on the
CPU (each family runs in a child process with that bound).

    python benchmarks/families.py                       # every family: an hour or more
    python benchmarks/families.py --only gpt2,opt,stablelm --layouts tp2,pp2
    python benchmarks/families.py --markdown table.md --json table.json

The suite runs one family for each way of writing attention and embeddings
(``tests/distributed/test_families.py``); this script is the whole table.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

FP32 = ("parallelism.mp_policy={_target_:torch.distributed.fsdp.MixedPrecisionPolicy,"
        "param_dtype:float32,reduce_dtype:float32}")
BASE = ["data=corpus", "data.num_documents=200", "trainer.max_steps=3", "trainer.log_every=1",
        "trainer.global_batch_size=8", "trainer.seq_len=32", "optim.warmup_steps=0",
        "optim.lr=0.01", "distributed.backend=gloo"]
LAYOUTS = {
    "fsdp2": ["parallelism=fsdp2", FP32],
    "tp2": ["parallelism=fsdp2", FP32, "mesh.tp_size=2"],
    "pp2": ["parallelism=fsdp2", FP32, "pipeline=1f1b", "pipeline.pp_microbatch_size=2"],
    "bf16": ["parallelism=fsdp2"],  # (the default mp_policy: bfloat16 weights)
}
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
# the default precision against the float32 process (as tests/distributed/test_parity.py)
BF16_LOSS_RTOL, BF16_GRAD_RTOL, BF16_FIRST_GRAD_RTOL = 2e-2, 1e-1, 2e-2

# size keys (or their attribute_map aliases) a tiny model takes, where the family has them
TINY = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 256, "ffn_dim": 128, "n_inner": 128, "word_embed_proj_dim": 64,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "num_experts": 4,
    "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 32,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "n_group": 1,
    "topk_group": 1, "sliding_window": 64, "rotary_dim": 8, "d_kv": 16,
    "num_experts_per_token": 2,
    # (Kimi-Linear's delta-rule attention falls back to a reference kernel that keeps a
    # head_dim x head_dim state per head and chunk: 9 GiB at its default 32 x 128)
    "linear_num_heads": 4, "linear_head_dim": 16,
    "init_std": 0.02,  # (CpmAnt's default of 1.0 starts at a loss of 23: chaotic steps)
}


def tiny_config(model_type: str) -> dict:
    """``model.config`` of a tiny model of the family: its default config's size keys set
    small, dropouts and router jitter 0, lists with a value per layer cut to the new
    depth, special token ids inside the small vocabulary."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    layers = getattr(default, "num_hidden_layers", None)
    out: dict = {"model_type": model_type}
    for key, value in TINY.items():
        settable = not isinstance(getattr(type(default), key, None), property)
        if settable and hasattr(default, key) and getattr(default, key) is not None:
            out[key] = value
    if "qk_rope_head_dim" in out and "head_dim" in out:  # (MLA: head_dim is the rope part)
        out["head_dim"] = out["qk_rope_head_dim"]
    for key, value in default.to_dict().items():
        random = ("dropout", "pdrop", "jitter")  # (parity needs a deterministic model)
        if isinstance(value, float) and any(w in key for w in random) and value:
            out[key] = 0.0
        if isinstance(value, list) and layers and len(value) == layers:
            out[key] = value[:TINY["num_hidden_layers"]]
        if (key.endswith("token_id") and isinstance(value, int)
                and value >= TINY["vocab_size"]):  # (special tokens inside the vocabulary)
            out[key] = TINY["vocab_size"] - 1
    return out


def save_tiny(model_type: str, folder: Path) -> str:
    """Build the tiny model on the host (seed 0), save it; returns its folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {k: v for k, v in tiny_config(model_type).items() if k != "model_type"}
    config = AutoConfig.for_model(model_type, **kwargs)
    with torch.device("meta"):  # (counted before any memory is taken: an image-text family's
        shape = AutoModelForCausalLM.from_config(config)  # sub-configs stay full size)
    params = sum(p.numel() for p in shape.parameters())
    if params > 30e6:
        raise ValueError(f"{params / 1e6:.0f}M parameters: its default config does not shrink")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = folder / model_type
    model.save_pretrained(str(path))
    return str(path)


def _train(overrides: list, folder: Path):
    from automodel.api import run

    return run(BASE + overrides, output_dir=tempfile.mkdtemp(dir=folder))


def _first_words(err: BaseException, n: int = 220) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = " ".join(lines[:3])
    if " fails in " in text and "on fake tensors" in text:  # (the fake step: where and why)
        where = text.split(" fails in ", 1)[1].split(". Every rank would fail", 1)[0]
        return f"fake step fails in {where}"[:n]
    return f"{type(err).__name__}: {text}"[:n]


def _compare(records, ref, loss_rtol=LOSS_RTOL, grad_rtol=GRAD_RTOL) -> str:
    losses = [(r["loss"], q["loss"]) for r, q in zip(records, ref)]
    norms = [(r["grad_norm"], q["grad_norm"]) for r, q in zip(records, ref)]
    if len(records) != len(ref) or not all(math.isfinite(a) for a, _ in losses):
        return f"FAILS: {len(records)} steps of {len(ref)}, losses {[a for a, _ in losses]}"
    dl = max(abs(a - b) / abs(b) for a, b in losses)
    dg = max(abs(a - b) / abs(b) for a, b in norms)
    if dl <= loss_rtol and dg <= grad_rtol:
        return f"works ({dl:.0e} / {dg:.0e})"
    first = abs(norms[0][0] - norms[0][1]) / abs(norms[0][1])
    if loss_rtol == BF16_LOSS_RTOL and dl <= loss_rtol and first <= BF16_FIRST_GRAD_RTOL:
        return (f"drifts: step 1 within bfloat16's tolerance ({first:.0e} in the grad norm), "
                f"later grad norms off by up to {dg:.1e} (losses within {dl:.0e})")
    return f"FAILS: off by {dl:.1e} in loss, {dg:.1e} in grad norm"


def family_row(model_type: str, layouts: list, folder: Path) -> dict:
    from automodel.config.build import ConfigError

    row = {"family": model_type}
    try:
        path = save_tiny(model_type, folder)
    except Exception as err:  # (transformers' configs and models raise all kinds)
        row["built"] = f"not built tiny: {_first_words(err)}"
        return row
    model = ["model=pretrained", f"model.pretrained_path={path}"]
    try:
        ref = _train(["parallelism=none"] + model, folder)
    except ConfigError as err:
        row["built"] = f"refused in one process: {_first_words(err)}"
        return row
    except Exception as err:
        row["built"] = f"not trainable tiny, in one process: {_first_words(err)}"
        return row
    row["built"] = "yes"
    for name in layouts:
        start = time.monotonic()
        try:
            tolerance = (BF16_LOSS_RTOL, BF16_GRAD_RTOL) if name == "bf16" else ()
            row[name] = _compare(_train(LAYOUTS[name] + model, folder), ref, *tolerance)
            if row[name].startswith("FAILS: off by") and not tolerance:
                row[name] = _at_larger_eps(row[name], LAYOUTS[name] + model, model, folder)
        except ConfigError as err:
            row[name] = f"refused: {_first_words(err)}"
        except Exception as err:
            row[name] = f"FAILS: {_first_words(err)}"
        row[f"{name}_s"] = round(time.monotonic() - start, 1)
    return row


def _at_larger_eps(mismatch: str, layout: list, model: list, folder: Path) -> str:
    eps = ["optim.eps=1e-4"]
    again = _compare(_train(layout + eps, folder), _train(["parallelism=none"] + model + eps,
                                                          folder))
    if not again.startswith("works"):
        return mismatch
    return f"rounding: {mismatch.split(': ', 1)[1]} at AdamW's eps 1e-8; at 1e-4 {again}"


def families(only: str | None) -> list:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    return [n for n in names if only is None or n in only.split(",")]


def markdown(rows: list, layouts: list) -> str:
    head = ["family", "built", *layouts]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row.get(k, "") for k in head]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _row_in_child(model_type: str, layouts: list, seconds: float) -> dict:
    """The family's row from a child process (``--row``), within ``seconds``: a family whose
    run is slow on the CPU (reference kernels of state-space layers) does not hold up the
    table."""
    import subprocess
    import sys

    cmd = [sys.executable, __file__, "--row", model_type, "--layouts", ",".join(layouts)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired:
        return {"family": model_type, "built": f"not timed: over {seconds:.0f} s on this CPU"}
    rows = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not rows:
        return {"family": model_type,
                "built": f"FAILS: the row's process exited {done.returncode}: "
                         f"{done.stderr.strip()[-200:]}"}
    return json.loads(rows[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", help="comma-separated model types (default: every family)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="of " + ", ".join(LAYOUTS))
    p.add_argument("--seconds", type=float, default=240, help="at most, per family")
    p.add_argument("--json", help="write the rows here (rewritten after each family)")
    p.add_argument("--markdown", help="write the table here (rewritten after each family)")
    p.add_argument("--row", help=argparse.SUPPRESS)  # (one family, in a child process)
    args = p.parse_args()
    layouts = args.layouts.split(",")
    if args.row:
        with tempfile.TemporaryDirectory(prefix="families-") as tmp:
            print(json.dumps(family_row(args.row, layouts, Path(tmp))), flush=True)
        return
    rows = []
    for model_type in families(args.only):
        rows.append(_row_in_child(model_type, layouts, args.seconds))
        print(json.dumps(rows[-1]), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        if args.markdown:
            Path(args.markdown).write_text(markdown(rows, layouts))
    print(markdown(rows, layouts))
    counts = {k: sum(1 for r in rows for name in layouts if r.get(name, "").startswith(k))
              for k in ("works", "rounding", "drifts", "refused", "FAILS")}
    print(f"{len(rows)} families; runs: {counts}")


if __name__ == "__main__":
    main()
