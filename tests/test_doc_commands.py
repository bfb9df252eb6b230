"""Every ``train.py`` command in README.md and docs/*.md composes and passes validation, in the
environment it states, so the docs cannot drift from the code.

Commands are read from the fenced code blocks (line continuations joined, comments dropped,
``a && b`` split). Forms: ``python train.py ...`` (local ranks, on this CPU machine),
``torchrun [--nnodes N] --nproc_per_node N train.py ...`` (torchrun's environment), ``srun python
train.py ...`` in a batch script (the SLURM task environment its ``#SBATCH`` lines give, with
``--gpus-per-node`` GPUs through the probe the tests patch), ``python -m launchers.slurm ...``
and ``train.py -m hydra/launcher=slurm ...`` (the submitter's environment and preflight
``gpus``). ``-m`` sweeps are expanded with Hydra's own parser and every job is checked.

Paths the docs write as placeholders are replaced by files of the ``doc_files`` fixture, per
document, in ``PLACEHOLDERS`` (nothing is skipped: a placeholder without an entry fails). The
commands of docs/recipes.md also run the preflight (runtime, resume checkpoint, the model's
layout on a meta-device model of the real architecture, and the data: the token cache is built
from a small chat JSONL) and the meta-device model is checked to have the real size.
"""

from __future__ import annotations

import itertools
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RECIPES = "docs/recipes.md"

# Placeholder -> fixture path (relative to the fixture folder), per document. "*" applies to all.
PLACEHOLDERS = {
    "*": {"$LLAMA_8B_INSTRUCT": "llama3_1_8b", "$LLAMA_70B_INSTRUCT": "llama3_1_70b",
          "$QWEN3_30B_A3B": "qwen3_30b_a3b", "$LLAVA_NEXT_72B": "llava_next_72b",
          "$DATA": "data", "$EXP": "exp"},
    "docs/checkpoints.md": {"outputs/.../checkpoints/step_00000300":
                            "exp/checkpoints/step_00000300"},
    "docs/data.md": {"/data/my_corpus": "data/my_corpus", "/models/my_tokenizer": "tokenizer",
                     "/data/shards/*.parquet": "data/shards/*.parquet",
                     "/data/sft.jsonl": "data/sft.jsonl", "/data/tokens.npy": "data/tokens.npy",
                     "/data/doc_starts.npy": "data/doc_starts.npy"},
    "docs/image_text.md": {"DIR": "llava", "PROCESSOR_DIR": "tokenizer",
                           "samples.jsonl": "data/samples.jsonl"},
    "docs/mixture_of_experts.md": {"DIR": "qwen3_30b_a3b"},
}
# "..." in a command means "and your other options": it stands for nothing.
ELLIPSIS = "..."
# Commands shown failing on purpose: the text of the command -> the error it must give.
EXPECTED_ERRORS = {
    "parallelism=ddp parallelism.bucket_cap=25": "Did you mean 'parallelism.bucket_cap_mb'",
}
# Real sizes (Hugging Face config.json of meta-llama/Llama-3.1-8B-Instruct, -70B-Instruct and
# Qwen/Qwen3-30B-A3B).
LLAMA3_1 = dict(vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
                tie_word_embeddings=False, num_key_value_heads=8,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
LLAMA3_1_8B = dict(LLAMA3_1, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32)
LLAMA3_1_70B = dict(LLAMA3_1, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                    num_attention_heads=64)
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645)
# llava-hf/llava-next-72b-hf: a CLIP ViT-L/14 tower at 336 pixels and Qwen1.5-72B-Chat
LLAVA_NEXT_72B = dict(
    vision_config=dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096,
                       projection_dim=768, num_hidden_layers=24, num_attention_heads=16,
                       image_size=336, patch_size=14, vocab_size=32000),
    text_config=dict(model_type="qwen2", vocab_size=152064, hidden_size=8192,
                     intermediate_size=24576, num_hidden_layers=80, num_attention_heads=64,
                     num_key_value_heads=64, max_position_embeddings=32768,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    image_token_index=151646, vision_feature_layer=-2, vision_feature_select_strategy="default",
    image_grid_pinpoints=[[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
    tie_word_embeddings=False)
REAL_PARAMETERS = {"llama3_1_8b": 8.03e9, "llama3_1_70b": 70.6e9, "qwen3_30b_a3b": 30.5e9,
                   "llava_next_72b": 72.7e9}
# The batch scripts docs/recipes.md shows, each verbatim from its file
SCRIPTS = ROOT / "examples" / "slurm"


@dataclass
class DocCommand:
    where: str  # file:line
    doc: str
    text: str
    launcher: str  # local | torchrun | srun | submitter
    args: list = field(default_factory=list)  # train.py's arguments (overrides and flags)
    world: int = 0  # torchrun / SLURM: ranks; nodes x tasks per node
    tasks_per_node: int = 1
    gpus_per_node: int | None = None


# ----------------------------------------------------------------------------- collecting
def code_blocks(text: str):
    """(first line number, lines) of each fenced block."""
    block, start = None, 0
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if block is None:
                block, start = [], n + 1
            else:
                yield start, block
                block = None
        elif block is not None:
            block.append(line.strip())


def logical_lines(start: int, lines: list):
    """(line number, text) with backslash continuations joined."""
    buf, first = "", start
    for n, line in enumerate(lines, start):
        if not buf:
            first = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        yield first, buf + line
        buf = ""


def sbatch_options(lines: list) -> dict:
    opts = {}
    for line in lines:
        m = re.match(r"#SBATCH\s+--([\w-]+)=(\S+)", line)
        if m:
            opts[m.group(1)] = m.group(2)
    return opts


def collect() -> list:
    found = []
    for path in DOCS:
        doc = str(path.relative_to(ROOT))
        for start, lines in code_blocks(path.read_text()):
            sbatch = sbatch_options(lines)
            for n, text in logical_lines(start, lines):
                if not any(k in text for k in ("train.py", "launchers.slurm", "plan.py")):
                    continue
                text = text[2:] if text.startswith("$ ") else text  # a prompt
                for part in text.split("&&"):
                    cmd = parse(part, f"{doc}:{n}", doc, sbatch)
                    if cmd is not None:
                        found.append(cmd)
    return found


def parse(text: str, where: str, doc: str, sbatch: dict):
    tokens = [t for t in shlex.split(text, comments=True) if t != ELLIPSIS]
    while tokens and re.match(r"^[A-Z_]+=", tokens[0]):  # VAR=value before the command
        tokens.pop(0)
    if not tokens or not (tokens[0].endswith("python") or tokens[0] in ("torchrun", "srun")):
        return None  # (e.g. the code map's "train.py   Hydra entry point")
    if not any(t.endswith(("train.py", "plan.py")) or t == "launchers.slurm" for t in tokens):
        return None
    head, cmd = tokens[0], DocCommand(where, doc, text.strip(), "local")
    if len(tokens) > 1 and tokens[1] == "plan.py":  # planned, not run: plan.py's own path
        cmd.launcher, cmd.args = "plan", tokens[2:]
        return cmd
    if head == "srun":
        i = next(i for i, t in enumerate(tokens) if t.endswith("train.py"))
        cmd.launcher, cmd.args = "srun", tokens[i + 1:]
        nodes, cmd.tasks_per_node = int(sbatch["nodes"]), int(sbatch["ntasks-per-node"])
        cmd.world, cmd.gpus_per_node = nodes * cmd.tasks_per_node, int(sbatch["gpus-per-node"])
    elif head == "torchrun":
        i = next(i for i, t in enumerate(tokens) if t.endswith("train.py"))
        flags = dict(re.match(r"--([\w-]+)(?:=(.*))?", t).groups() for t in tokens[1:i]
                     if t.startswith("--") and "=" in t)
        pairs = {tokens[j][2:]: tokens[j + 1] for j in range(1, i - 1)
                 if tokens[j].startswith("--") and "=" not in tokens[j]}
        flags.update(pairs)
        cmd.tasks_per_node = int(flags.get("nproc_per_node", flags.get("nproc-per-node", 1)))
        cmd.launcher, cmd.args = "torchrun", tokens[i + 1:]
        cmd.world = int(flags.get("nnodes", 1)) * cmd.tasks_per_node
    elif tokens[1:3] == ["-m", "launchers.slurm"]:
        parse_submitter(cmd, tokens[3:])
    else:
        assert head.endswith("python") and tokens[1] == "train.py", f"{where}: unknown form"
        cmd.args = tokens[2:]
        if "hydra/launcher=slurm" in cmd.args:
            hl = dict(a[len("hydra.launcher."):].split("=", 1) for a in cmd.args
                      if a.startswith("hydra.launcher."))
            cmd.launcher, cmd.tasks_per_node = "submitter", int(hl.get("tasks_per_node", 1))
            cmd.world = int(hl.get("nodes", 1)) * cmd.tasks_per_node
            gpus = hl.get("gpus_per_node")
            cmd.gpus_per_node = int(gpus) if gpus else None
    return cmd


def parse_submitter(cmd: DocCommand, tokens: list) -> None:
    """``python -m launchers.slurm`` flags, as its argparse defines them."""
    values = {"--nodes": 1, "--tasks-per-node": 1, "--gpus-per-node": None}
    takes_value = {"--cpus-per-task", "--partition", "--account", "--time-min", "--folder",
                   "--output-dir", *values}
    rest, it = [], iter(tokens)
    for t in it:
        if t in takes_value:
            values[t] = next(it)
        elif t == "--wait":
            continue
        else:
            assert not t.startswith("--"), f"{cmd.where}: launchers.slurm has no flag {t}"
            rest.append(t)
    cmd.launcher, cmd.args = "submitter", rest
    cmd.tasks_per_node = int(values["--tasks-per-node"])
    cmd.world = int(values["--nodes"]) * cmd.tasks_per_node
    g = values["--gpus-per-node"]
    cmd.gpus_per_node = int(g) if g is not None else None


COMMANDS = collect()


# ----------------------------------------------------------------------------- fixture files
@pytest.fixture(scope="module")
def doc_files(tmp_path_factory):
    """The files the docs' placeholders stand for: real-size model configs (no weights) with
    a small word-level tokenizer that has a chat template, data files and folders."""
    from transformers import AutoConfig, LlamaConfig, LlavaNextConfig, Qwen3MoeConfig

    from automodel.api import load_config
    from tests.helpers import chat_records, save_chat_tokenizer

    root = tmp_path_factory.mktemp("doc_files")
    chat = chat_records()
    tok = save_chat_tokenizer(root / "tokenizer", chat)
    for name, config in (("llama3_1_8b", LlamaConfig(**LLAMA3_1_8B)),
                         ("llama3_1_70b", LlamaConfig(**LLAMA3_1_70B)),
                         ("qwen3_30b_a3b", Qwen3MoeConfig(**QWEN3_30B_A3B))):
        config.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    LlavaNextConfig(**LLAVA_NEXT_72B).save_pretrained(root / "llava_next_72b")
    tok.save_pretrained(root / "llava_next_72b")
    llava = load_config(["model=llava_tiny"]).model.config
    AutoConfig.for_model(**llava).save_pretrained(root / "llava")
    data = root / "data"
    (data / "shards").mkdir(parents=True)
    (data / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    (data / "sft.jsonl").write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    (data / "samples.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    (data / "images.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    (data / "shards" / "a.parquet").write_bytes(b"")
    (data / "my_corpus").mkdir()
    import numpy as np

    np.save(data / "tokens.npy", np.arange(1000, dtype=np.int32) % 200)
    np.save(data / "doc_starts.npy", np.array([0, 500]))
    (root / "exp" / "checkpoints" / "step_00000300").mkdir(parents=True)
    return root


def substitute(cmd: DocCommand, root: Path) -> list:
    table = {**PLACEHOLDERS["*"], **PLACEHOLDERS.get(cmd.doc, {})}
    out = []
    for arg in cmd.args:
        for name in sorted(table, key=len, reverse=True):
            pattern = r"(?<![\w/])" + re.escape(name) + r"(?![\w])"
            arg = re.sub(pattern, lambda _m, n=name: str(root / table[n]), arg)
        assert "$" not in arg, f"{cmd.where}: no fixture for the placeholder in {arg!r}"
        out.append(arg)
    return out


# ----------------------------------------------------------------------------- the check
def jobs(args: list) -> list:
    """The jobs a command runs: one, or each job of a ``-m`` sweep (Hydra's own expansion)."""
    flags = {"-m", "--multirun"}
    overrides, it = [], iter(args)
    multirun = False
    for a in it:
        if a in flags:
            multirun = True
        elif a in ("--cfg", "-c"):
            next(it)
        else:
            assert not a.startswith("-"), f"unknown train.py flag {a}"
            overrides.append(a)
    if not multirun:
        return [overrides]
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices = []
    for o in OverridesParser.create().parse_overrides(overrides):
        key = o.get_key_element()
        choices.append([f"{key}={v}" for v in o.sweep_string_iterator()]
                       if o.is_sweep_override() else [o.input_line])
    return [list(job) for job in itertools.product(*choices)]


def environment(cmd: DocCommand) -> tuple:
    """(environment to resolve in, GPUs per rank for the preflight, GPUs the machine has)."""
    from automodel.launch.slurm import submit_env

    if cmd.launcher == "torchrun":
        return ({"TORCHELASTIC_RUN_ID": "doc", "RANK": "0", "WORLD_SIZE": str(cmd.world),
                 "LOCAL_WORLD_SIZE": str(cmd.tasks_per_node), "MASTER_ADDR": "node0"}, 0, 0)
    if cmd.launcher == "srun":
        return ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": str(cmd.world),
                 "SLURM_STEP_NUM_TASKS": str(cmd.world),
                 "SLURM_STEP_TASKS_PER_NODE":
                     f"{cmd.tasks_per_node}(x{cmd.world // cmd.tasks_per_node})",
                 "SLURM_PROCID": "0"}, cmd.gpus_per_node, cmd.gpus_per_node)
    if cmd.launcher == "submitter":
        return submit_env(cmd.world // cmd.tasks_per_node, cmd.tasks_per_node), \
            cmd.gpus_per_node, 0
    return {}, 0, 0


def check(cmd: DocCommand, root: Path, tmp_path: Path, monkeypatch) -> list:
    """Compose and resolve every job as the CLI does; for recipes, also the preflight and the
    model's size on the meta device. Returns the resolved configs."""
    from automodel.api import load_config
    from automodel.checks.preflight import preflight
    from automodel.config.cli_check import check_cli_overrides

    env, rank_gpus, machine_gpus = environment(cmd)
    monkeypatch.setattr("automodel.config.launch_env.gpu_device_probe", lambda: machine_gpus or 0)
    resolved = []
    if cmd.launcher == "plan":  # resolved as plan.py resolves it (no simulation)
        from automodel.plan_cli import load_plan

        return [load_plan(substitute(cmd, root), str(tmp_path))[0]]
    for overrides in jobs(substitute(cmd, root)):
        check_cli_overrides(overrides)
        cfg = load_config(overrides, output_dir=str(tmp_path), env=env)
        if cmd.doc == RECIPES:
            preflight(cfg, gpus=rank_gpus)
        resolved.append(cfg)
    return resolved


@pytest.mark.fast  # one process, no process group
def test_the_docs_have_commands():
    """The collection finds what the docs hold (a parser that finds nothing checks nothing)."""
    where = {c.doc for c in COMMANDS}
    assert {"README.md", RECIPES, "docs/data.md", "docs/mixture_of_experts.md"} <= where
    recipes = [c for c in COMMANDS if c.doc == RECIPES and c.launcher != "plan"]
    assert [c.launcher for c in recipes] == ["srun", "submitter"] + ["srun"] * 6
    assert [c.world for c in recipes] == [16, 16, 16, 16, 32, 8, 2, 16]
    assert [c.gpus_per_node for c in recipes] == [8] * 6 + [2, 8]
    plans = [c for c in COMMANDS if c.doc == RECIPES and c.launcher == "plan"]
    assert len(plans) == len(list(SCRIPTS.glob("*.sbatch")))  # one plan.py line per script
    kinds = {c.launcher for c in COMMANDS}
    assert {"local", "torchrun", "srun", "submitter", "plan"} <= kinds
    assert {"local", "torchrun"} <= {c.launcher for c in COMMANDS if c.doc == "README.md"}
    assert {c.doc for c in COMMANDS if c.launcher == "plan"} >= {"docs/planning.md"}
    slurm = [c for c in COMMANDS if c.doc == "docs/slurm.md"]
    assert {"submitter", "torchrun"} <= {c.launcher for c in slurm}
    assert any(c.text.startswith("python -m launchers.slurm") for c in slurm)
    sweep = next(c for c in COMMANDS if "parallelism=ddp,fsdp2 optim.lr" in c.text)
    assert len(jobs(sweep.args)) == 4


@pytest.mark.fast
@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.doc != RECIPES],
                         ids=lambda c: c.where)
def test_doc_command_validates(cmd, doc_files, tmp_path, monkeypatch):
    from automodel.config.build import ConfigError

    expected = next((msg for text, msg in EXPECTED_ERRORS.items() if text in cmd.text), None)
    if expected is None:
        assert check(cmd, doc_files, tmp_path, monkeypatch)
        return
    with pytest.raises(ConfigError, match=re.escape(expected)):
        check(cmd, doc_files, tmp_path, monkeypatch)


RECIPE_LAYOUTS = {  # (pp, dp_replicate, dp_shard, tp, ep) of each recipe, as its text says
    "llama3_1_8b": {(1, 2, 8, 1, 1), (2, 1, 1, 8, 1)},
    "llama3_1_70b": {(4, 1, 2, 4, 1), (1, 1, 8, 1, 1), (1, 1, 2, 1, 1)},  # (full; LoRA; QLoRA)
    "qwen3_30b_a3b": {(1, 1, 16, 1, 8)},
    "llava_next_72b": {(2, 1, 1, 8, 1)},
}


# (not fast: each real-size recipe's fake step, a pipeline of 8 micro-batches at its width,
# takes seconds; docs/contributing.md)
@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.doc == RECIPES and c.launcher != "plan"],
                         ids=lambda c: c.where)
def test_recipe_passes_preflight(cmd, doc_files, tmp_path, monkeypatch):
    """A recipe resolves in its SLURM environment to the layout its text describes, passes the
    preflight, and its model (on the meta device) has the real size. The preflight sees a CUDA
    build of torch (mocked: this machine's is a CPU build, which the preflight refuses where
    the job has GPUs; tests/launch/test_slurm_env.py tests that refusal)."""
    from automodel.models.builder import build_meta_model

    monkeypatch.setattr("automodel.checks.support.torch_build", lambda: ("2.13.0+cu128", True))
    (cfg,) = check(cmd, doc_files, tmp_path, monkeypatch)
    lay = cfg.layout
    assert lay.world_size == cmd.world
    name = Path(cfg.model.pretrained_path).name
    layout = (lay.pp, lay.dp_replicate, lay.dp_shard, lay.tp, lay.ep)
    assert layout in RECIPE_LAYOUTS[name], layout
    params = sum(p.numel() for p in build_meta_model(cfg.model).parameters())
    assert params == pytest.approx(REAL_PARAMETERS[name], rel=0.01)


def _recipe_blocks() -> dict:
    """{file named just before a bash block of docs/recipes.md: the block's text}."""
    text = (ROOT / RECIPES).read_text()
    return {m.group(1): m.group(2) for m in re.finditer(
        r"`(examples/slurm/[\w.]+\.sbatch)`[^`]*?:\n\n```bash\n(.*?)```", text, re.S)}


@pytest.mark.fast
def test_the_recipes_show_their_batch_scripts_verbatim():
    """Each batch script of examples/slurm is on docs/recipes.md as it is in its file (the
    file is what users submit and tests/launch/test_recipes_slurm.py runs)."""
    blocks = _recipe_blocks()
    files = {str(p.relative_to(ROOT)) for p in SCRIPTS.glob("*.sbatch")}
    assert set(blocks) == files, (sorted(blocks), sorted(files))
    for name, block in blocks.items():
        assert block == (ROOT / name).read_text(), f"{RECIPES} shows {name} otherwise"


ADAPTER_RECIPES = ["examples/slurm/llama3_1_70b_instruct_lora.sbatch",
                   "examples/slurm/llama3_1_70b_instruct_qlora.sbatch"]


def _section(script: str) -> tuple[str, range]:
    """docs/recipes.md from the script's block to the next heading, and its line numbers."""
    text = (ROOT / RECIPES).read_text()
    start = text.index(f"`{script}`:")
    end = text.find("\n## ", start)
    end = len(text) if end < 0 else end
    first = text.count("\n", 0, start) + 1
    return text[start:end], range(first, first + text.count("\n", start, end) + 1)


@pytest.mark.parametrize("script", ADAPTER_RECIPES, ids=lambda s: Path(s).stem)
def test_an_adapter_recipe_states_the_plan_of_what_it_runs(script, doc_files, tmp_path,
                                                           monkeypatch):
    """The recipe's plan.py line asks for the options its script runs (every one of its
    train.py keys is on the script's srun line), and the peak, overhead and step time the
    text states are that plan's, within 5%."""
    from automodel.costing.gpus import profile
    from automodel.plan_cli import load_plan
    from automodel.planning.plan import make_plan

    section, lines = _section(script)
    (plan_cmd,) = [c for c in COMMANDS if c.doc == RECIPES and c.launcher == "plan"
                   and int(c.where.rsplit(":", 1)[1]) in lines]
    srun = (ROOT / script).read_text().replace("\\\n", " ").split()
    assert [a for a in plan_cmd.args if not a.startswith("plan.") and a not in srun] == []
    train, plan = load_plan(substitute(plan_cmd, doc_files), str(tmp_path))
    result = make_plan(train, profile(plan.gpu), workers=1)
    stated = re.search(r"predicts ([\d.]+) GiB per rank \(\+([\d.]+) GiB of CUDA context "
                       r"and buffers\) and ([\d.]+) s per step", section)
    rank = result["ranks"][0]
    for text, planned in zip(stated.groups(), (rank["peak_bytes"] / 2**30,
                                               rank["overhead_bytes"] / 2**30,
                                               result["step_time_s"])):
        assert float(text) == pytest.approx(planned, rel=0.05), (text, planned)
