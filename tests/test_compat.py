"""automodel.compat: every torch/transformers internal automodel patches or reads, checked
before any rank starts, and touched nowhere else in the package."""

import ast
import os
import pathlib
import re

import pytest

from automodel import compat
from automodel.compat import INTERNALS, CompatError, check_compat, verified

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "automodel"
ALL_INTERNALS = [*INTERNALS, *compat.PLANNING_INTERNALS,  # (the planner's: plan.py)
                 *compat.QLORA_INTERNALS]  # (peft=qlora: torchao)


def _error(monkeypatch_action) -> str:
    monkeypatch_action()
    with pytest.raises(CompatError) as err:
        check_compat()
    return str(err.value)


@pytest.mark.fast
def test_installed_versions_pass_and_every_entry_names_its_feature():
    check_compat()
    names = [e.name for e in INTERNALS]
    assert len(names) == len(set(names)) >= 30
    for e in INTERNALS:
        assert e.library in ("torch", "transformers") and e.feature, e


@pytest.mark.fast
def test_a_removed_attribute_is_named_with_its_feature_and_the_versions(monkeypatch):
    from torch.distributed.pipelining import stage
    from transformers import modeling_flash_attention_utils as fa

    message = _error(lambda: (monkeypatch.delattr(fa, "_is_packed_sequence"),
                              monkeypatch.delattr(stage._PipelineStageBase,
                                                  "_retrieve_recv_grads")))
    assert ("transformers.modeling_flash_attention_utils._is_packed_sequence: missing; "
            "patches it for: parallelism.patch_is_packed_sequence") in message
    assert ("torch.distributed.pipelining.stage.PipelineStage._retrieve_recv_grads: missing; "
            "patches it for: pipeline.pp_recv_buffer_pool") in message
    assert "perform_reduce_grad" not in message  # (only what is wrong)
    versions = compat.core.installed_versions()
    assert f"installed: torch {versions['torch']}, transformers {versions['transformers']}" \
        in message
    assert "tested with torch 2.13.0" in message and "pins torch>=2.13,<2.15" in message


@pytest.mark.fast
def test_a_changed_signature_or_type_is_named(monkeypatch):
    import torch._inductor.config as inductor_config
    from torch.distributed.pipelining import stage

    def reduce(self, scale):  # (a renamed parameter)
        pass

    message = _error(lambda: (
        monkeypatch.setattr(stage._PipelineStageBase, "perform_reduce_grad", reduce),
        monkeypatch.setitem(vars(inductor_config), "_micro_pipeline_tp", "on")))
    assert ("PipelineStage.perform_reduce_grad: parameters (self, scale), expected (self, "
            "grad_scale_factor, ...); patches it for: "
            "pipeline.patch_stage_backward_maybe_with_nosync") in message
    assert ("torch._inductor.config._micro_pipeline_tp: a str, expected a bool; patches it "
            "for: parallelism.enable_async_tensor_parallel") in message


@pytest.mark.fast
def test_an_instance_attribute_no_longer_set_is_named(monkeypatch):
    from torch.distributed.pipelining import schedules

    def init(self, stages, n_microbatches, **kwargs):
        self.stages = stages

    message = _error(lambda: monkeypatch.setattr(schedules.PipelineScheduleMulti, "__init__",
                                                 init))
    assert ("torch.distributed.pipelining.schedules.PipelineScheduleMulti._stages: not "
            "assigned in __init__ any more; uses it for: pipeline parallelism") in message


@pytest.mark.fast
def test_the_check_refuses_the_run_before_any_rank_starts(monkeypatch, tmp_path):
    """``automodel.api.run`` (as the CLI) stops in its pre-launch checks, as a configuration
    error (exit code 2 from the CLI), and writes nothing."""
    from transformers.utils import output_capturing

    from automodel.api import run
    from automodel.config.build import ConfigError

    monkeypatch.delattr(output_capturing, "_CAN_RECORD_REGISTRY")
    with pytest.raises(ConfigError, match=r"_CAN_RECORD_REGISTRY: missing; patches it for: "
                                          r"FSDP2 sharding"):
        run(["data=corpus", "data.num_documents=50"], output_dir=str(tmp_path))
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.fast
def test_pinned_ranges_are_pyprojects():
    text = (ROOT / "pyproject.toml").read_text()  # (tomllib: Python 3.11+)
    pins = dict(re.findall(r'^\s*"(torch|transformers|torchao)\s*([<>=!~][^"]*)",', text, re.M))
    assert pins == compat.PINNED


@pytest.mark.fast
def test_the_test_environment_installs_the_tested_versions():
    """scripts/setup.sh installs with scripts/constraints.txt: transformers at the tested
    version (torch is pinned by setup.sh itself), whatever the newest release is."""
    lines = (ROOT / "scripts" / "constraints.txt").read_text().splitlines()
    pins = dict(line.split("==") for line in lines if line and not line.startswith("#"))
    assert pins["transformers"] == compat.TESTED_WITH["transformers"] and "torch" not in pins
    assert f'TORCH_VERSION={compat.TESTED_WITH["torch"]}' in \
        (ROOT / "scripts" / "setup.sh").read_text()
    assert "-c scripts/constraints.txt" in (ROOT / "scripts" / "setup.sh").read_text()


def _private_names() -> set[str]:
    """The private names (``_x``, not dunder) of every entry's module path and attribute."""
    parts = {p for e in ALL_INTERNALS for p in re.split(r"[.()]", e.name) if p}
    return {p for p in parts if p.startswith("_") and not p.startswith("__")}


def _patched_names() -> set[str]:
    return {e.attr.rsplit(".", 1)[-1] for e in ALL_INTERNALS if e.patched}


def _violations(path: pathlib.Path, private: set, patched: set) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        line = f"{path.name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute) and node.attr in private:
            found.append(f"{line}: .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in private:
            found.append(f"{line}: {node.value!r}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [
                node.module or ""] + [a.name for a in node.names]
            for name in modules:
                bits = name.split(".")
                if bits[0] in ("torch", "transformers") or isinstance(node, ast.ImportFrom) \
                        and (node.module or "").split(".")[0] in ("torch", "transformers"):
                    if any(b.startswith("_") and not b.startswith("__") for b in bits):
                        found.append(f"{line}: import {name}")
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [f"{line}: assigns .{t.attr}" for t in targets
                      if isinstance(t, ast.Attribute) and t.attr in patched]
    return found


@pytest.mark.fast
def test_no_module_outside_compat_touches_a_library_internal():
    """A new patch or private read outside automodel/compat/ fails here: the names of every
    entry (and any private torch/transformers module or name imported) may appear only there;
    a patched attribute (even a public one such as ``register_parameter``) is assigned only
    there."""
    private, patched = _private_names(), _patched_names()
    assert {"_parameters", "_is_packed_sequence", "_set_pg_timeout", "_micro_pipeline_tp",
            "_CAN_RECORD_REGISTRY", "_retrieve_recv_grads", "_inductor"} <= private
    assert {"perform_reduce_grad", "register_parameter", "find_packed_sequence_indices"} \
        <= patched
    found = [v for path in sorted(PACKAGE.rglob("*.py")) if "compat" not in path.parts
             for v in _violations(path, private, patched)]
    assert not found, "outside automodel/compat/:\n" + "\n".join(found)


@pytest.mark.fast
def test_the_scan_finds_a_scattered_patch(tmp_path):
    """(The test above can fail: each kind of use is found in a sample file.)"""
    sample = tmp_path / "sample.py"
    sample.write_text("import torch._inductor.config as c\n"
                      "from torch.distributed.tensor._utils import f\n"
                      "c._micro_pipeline_tp = True\n"
                      "stage.perform_reduce_grad = lambda s: None\n"
                      "getattr(schedule, '_stages')\n")
    found = _violations(sample, _private_names(), _patched_names())
    assert sorted(f.split(": ", 1)[1] for f in found) == [
        "'_stages'", "._micro_pipeline_tp", "assigns ._micro_pipeline_tp",
        "assigns .perform_reduce_grad",
        "import torch._inductor.config", "import torch.distributed.tensor._utils"]


def test_a_passed_check_is_remembered_per_installation(tmp_path):
    """A fresh process checks in full (it imports torch's compiler stack, transformers' masks)
    and writes the pass down; the next start on the same installation skips those imports."""
    import subprocess
    import sys

    probe = ("import sys; from automodel.compat import check_compat; check_compat(); "
             "print(sorted(m for m in ('torch._dynamo', 'transformers.masking_utils') "
             "if m in sys.modules))")
    env = {**os.environ, "AUTOMODEL_CACHE": str(tmp_path), "AUTOMODEL_COMPAT_CACHE": "1"}

    def start():
        out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert start() == "['torch._dynamo', 'transformers.masking_utils']"
    [entry] = (tmp_path / "compat").iterdir()
    assert entry.name == f"{verified.installation_key('training')}.ok"
    assert start() == "[]"
    env["AUTOMODEL_COMPAT_CACHE"] = "0"  # off: the full check again
    assert start() == "['torch._dynamo', 'transformers.masking_utils']"


@pytest.mark.fast
def test_the_key_names_the_installation(monkeypatch):
    key = verified.installation_key("training")
    assert key == verified.installation_key("training") != verified.installation_key("planning")
    real = verified._library_identity
    monkeypatch.setattr(verified, "_library_identity",
                        lambda name: [*real(name), "reinstalled"] if name == "torch"
                        else real(name))
    assert verified.installation_key("training") not in (key, None)
    monkeypatch.setattr(verified, "_library_identity", lambda name: None)  # not installed
    assert verified.installation_key("training") is None
    assert not verified.passed_before(None)


@pytest.mark.fast
def test_a_remembered_pass_does_not_hide_a_change_in_this_process(tmp_path, monkeypatch):
    from transformers import modeling_flash_attention_utils as fa

    monkeypatch.setenv("AUTOMODEL_CACHE", str(tmp_path))
    verified.remember_pass(verified.installation_key("training"))
    assert verified.passed_before(verified.installation_key("training"))
    message = _error(lambda: monkeypatch.delattr(fa, "_is_packed_sequence"))
    assert "_is_packed_sequence: missing" in message
