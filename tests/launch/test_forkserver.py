"""Local ranks are forked from one pre-imported server (automodel/launch/forkserver.py) and
still see the launcher's environment of the moment they start, not the server's."""

import os
import sys

from automodel.launch.local import run_on_local_ranks


def _report():
    return {"rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"],
            "added": os.environ.get("AUTOMODEL_TEST_ADDED"),
            "removed": os.environ.get("AUTOMODEL_TEST_REMOVED"),
            "preloaded": "transformers.models.auto.modeling_auto" in sys.modules,
            "parent": os.getppid()}


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
