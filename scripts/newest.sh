#!/usr/bin/env bash
# The fast tier against the newest versions pyproject.toml allows (no constraints file): a
# fresh .venv-newest, everything resolved by pip within the ranges, then `pytest -m fast`.
# Drift (a newer release inside a range that breaks something) ends with a line that names it,
# "newest: DRIFT ...", the versions it ran on, and exit code 3; a clean run with "newest: ok".
# CI runs it after the suite (.ci/run); run it by hand before widening or pinning a range.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
venv=.venv-newest
rm -rf "$venv"
"$PY" -m venv "$venv" || exit 1
pip=("$venv/bin/python" -m pip install -q)
"${pip[@]}" --upgrade pip || exit 1
if ! "${pip[@]}" -e ".[test,megatron]"; then
  echo "newest: DRIFT: the newest versions in range do not install together" >&2
  exit 3
fi
versions=$("$venv/bin/python" - <<'PY'
from importlib.metadata import version
names = ["torch", "transformers", "hydra-core", "omegaconf", "torchao", "datasets", "wandb",
         "submitit", "hydra-submitit-launcher"]
print(", ".join(f"{n} {version(n)}" for n in names))
PY
)
echo "newest: the fast tier on $versions"
if "$venv/bin/python" -m pytest -q -m fast -p no:cacheprovider "$@"; then
  echo "newest: ok ($versions)"
else
  echo "newest: DRIFT: the fast tier fails on the newest versions in range ($versions); pin" \
       "the range in pyproject.toml below the release that broke it, or fix and record it" \
       "in docs/compat.md" >&2
  exit 3
fi
