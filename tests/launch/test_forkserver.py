"""Local ranks are forked from one pre-imported server (automodel/runtime/forkserver.py) and
still see the launcher's environment of the moment they start, not the server's."""

import os
import sys

from automodel.launch.local import run_on_local_ranks


def _report():
    return {"rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"],
            "added": os.environ.get("AUTOMODEL_TEST_ADDED"),
            "removed": os.environ.get("AUTOMODEL_TEST_REMOVED"),
            "preloaded": "transformers.models.auto.modeling_auto" in sys.modules,
            "parent": os.getppid(),
            # the server's own environment (captured when it preloaded the module)
            "server_nvml_check": _server_env().get("PYTORCH_NVML_BASED_CUDA_CHECK")}


def _server_env():
    from automodel.runtime import forkserver

    return forkserver._START_ENV


def test_forked_ranks_see_the_launchers_environment_of_now(monkeypatch):
    monkeypatch.setenv("AUTOMODEL_TEST_REMOVED", "set before the server started")
    run_on_local_ranks(_report, 2)  # (starts the server, if this process has none yet)
    monkeypatch.delenv("AUTOMODEL_TEST_REMOVED")
    monkeypatch.setenv("AUTOMODEL_TEST_ADDED", "set after")
    out = run_on_local_ranks(_report, 2)
    assert sorted(r["rank"] for r in out.values()) == ["0", "1"]
    for r in out.values():
        assert r["world"] == "2"
        assert r["added"] == "set after"  # the launcher's, not the server's environment
        assert r["removed"] is None
        # forked from the server, which imported the heavy modules once
        assert r["preloaded"]
        assert r["parent"] != os.getpid()
        # torch in the server asks NVML, not the CUDA driver, whether CUDA is there: a driver
        # started before the fork would be unusable in the ranks
        assert r["server_nvml_check"] == "1"


PROBE = '''
import os, sys

def report():
    here = sys.modules["fs_probe"].LOADED_IN
    return {"preloaded": here != os.getpid(), "automodel": sys.modules["automodel"].__file__}
LOADED_IN = os.getpid()
'''

LAUNCHER = '''
import json, sys
sys.path.insert(0, sys.argv[1])  # only this process knows where fs_probe lives
import automodel
from automodel.runtime import forkserver
forkserver.PRELOAD.append("fs_probe")
from automodel.launch.local import run_on_local_ranks
import fs_probe
if __name__ == "__main__":
    out = run_on_local_ranks(fs_probe.report, 2)
    print(json.dumps({"ranks": list(out.values()), "automodel": automodel.__file__}))
'''


def test_the_server_imports_from_the_launchers_path(tmp_path):
    """The server preloads modules from the launching process's sys.path, so ranks run the
    launcher's automodel (not another checkout found on the server's default path)."""
    import json
    import subprocess

    lib = tmp_path / "lib"  # on no default path: not the script's folder, not the cwd
    lib.mkdir()
    (lib / "fs_probe.py").write_text(PROBE)
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    done = subprocess.run([sys.executable, str(script), str(lib)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for r in out["ranks"]:
        assert r["preloaded"], "the server did not find the module on the launcher's path"
        assert r["automodel"] == out["automodel"]
