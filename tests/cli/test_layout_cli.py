"""Rules on the model's own structure: refused before any rank starts. They are checked on a
meta-device copy of the model (torch and transformers are imported, no weights are
allocated) by the preflight every entry point runs; each rule here is checked in this process
as ``train.py`` checks it (compose, resolve, preflight), and one through the command line
itself (exit 2, no rank), which costs a Python process importing torch."""

import pytest

from tests.cli.test_cli import run
from tests.helpers import ON_CPU

RULES = [
    (["mesh.tp_size=4"], "must divide the model's num_key_value_heads=2"),
    (["mesh.tp_size=8"], "must divide the model's num_attention_heads=4"),
    (["mesh.tp_size=2", "model.config.vocab_size=257"], "vocab_size=257"),
    # mixture of experts: what the layout cannot give it
    (["mesh.ep_size=2"], "LlamaForCausalLM (model_type 'llama') has no experts modules"),
    (["mesh.ep_size=4", "mesh.dp_size=4", "model=qwen3_moe_tiny",
      "model.config.num_experts=6"], "mesh.ep_size=4 must divide the model's num_experts=6"),
    # (the router loss under a pipeline rides on the patched stage forward)
    (["model=qwen3_moe_tiny", "pipeline=1f1b", "pipeline.patch_causal_lm_model=false"],
     "set pipeline.patch_causal_lm_model=true"),
    (["model=qwen3_moe_tiny", "mesh.tp_size=2", "parallelism.sequence_parallel=true"],
     "set parallelism.sequence_parallel=false"),
    # context parallelism: what the exchange cannot split, named
    (["mesh.cp_size=2", "model=gemma2_tiny"], "does not support attention logit soft-capping"),
    (["mesh.cp_size=2", "model=granite_swa_tiny"],
     "does not support attention sinks (model.layers.0.self_attn.sinks)"),
    (["mesh.cp_size=2", "mesh.cp_ulysses_size=2", "mesh.tp_size=2"],
     "num_key_value_heads=2 / mesh.tp_size=2 = 1 per TP rank"),
    (["mesh.cp_size=8", "mesh.cp_ulysses_size=8"],
     "mesh.cp_ulysses_size=8 must divide the attention heads: the model has "
     "num_attention_heads=4"),
]


@pytest.mark.fast  # no process, no rank (the model is built on the meta device)
@pytest.mark.parametrize("args,expected", RULES)
def test_rule_on_the_model_structure_fails_before_any_rank(args, expected, tmp_path):
    from automodel.api import load_config
    from automodel.checks.preflight import preflight
    from automodel.config.build import ConfigError
    from automodel.config.cli_check import check_cli_overrides

    overrides = ["parallelism=fsdp2"] + args + ON_CPU
    check_cli_overrides(overrides)
    with pytest.raises(ConfigError) as refused:
        preflight(load_config(overrides, str(tmp_path)))
    assert expected in str(refused.value)


# (not fast: its fresh interpreter imports torch to build the model on the meta device)
def test_the_command_line_exits_2_before_any_rank(tmp_path):
    args, expected = RULES[0]
    out = run(["parallelism=fsdp2"] + args, tmp_path)
    assert out.returncode == 2, out.stderr
    assert expected in out.stderr and "configuration error" in out.stderr
    assert not list(tmp_path.rglob("metrics.jsonl"))  # no rank ran
