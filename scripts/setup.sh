#!/usr/bin/env bash
# Create .venv (if missing) and install automodel with its test dependencies. Idempotent.
# torch comes first, in the build that fits the machine: a CUDA build where an NVIDIA GPU is
# visible, else the CPU build (pinned as "+cpu", so a CPU machine never pulls a CUDA wheel).
# AUTOMODEL_TORCH overrides the choice: auto (the default) | cpu | cuda (= cu128) | cu<NNN>
# (that CUDA build from PyTorch's index, e.g. cu126) | other pip arguments, used as given
# (e.g. "torch==2.13.0+cu130 --extra-index-url https://download.pytorch.org/whl/cu130").
# `bash scripts/setup.sh --dry-run` prints the choice and whether it would install; no changes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0
CUDA_DEFAULT=cu128
TORCH_INDEX=https://download.pytorch.org/whl
dry_run=false
[ "${1:-}" = "--dry-run" ] && dry_run=true

# Is an NVIDIA GPU here? Torch-free: nvidia-smi lists one, or the driver made /dev/nvidia<N>.
nvidia_gpu() {
  local n files
  if command -v nvidia-smi >/dev/null 2>&1; then
    n=$(timeout 30 nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    if [ "${n:-0}" -gt 0 ]; then echo "nvidia-smi lists $n GPU(s)"; return 0; fi
  fi
  files=(/dev/nvidia[0-9]*)
  if [ -e "${files[0]}" ]; then echo "${#files[@]} GPU device file(s) /dev/nvidia<N>"; return 0; fi
  return 1
}

choice=${AUTOMODEL_TORCH:-auto}
why="AUTOMODEL_TORCH=$choice"
if [ "$choice" = auto ]; then
  if seen=$(nvidia_gpu); then choice=cuda why="auto: $seen"
  else choice=cpu why="auto: no NVIDIA GPU (none listed by nvidia-smi, no /dev/nvidia<N>)"; fi
fi
case "$choice" in
  cpu) variant=cpu torch_args=("torch==$TORCH_VERSION+cpu") ;;
  cuda | cu[0-9]*)
    variant=$choice
    [ "$variant" = cuda ] && variant=$CUDA_DEFAULT
    torch_args=("torch==$TORCH_VERSION+$variant" --extra-index-url "$TORCH_INDEX/$variant") ;;
  *) variant=custom; read -r -a torch_args <<<"$choice" ;;
esac

# The stamp records what was installed: the torch build and pip arguments, and pyproject.toml's
# and scripts/constraints.txt's hashes. A different choice (or torch version) or an edited
# pyproject.toml or constraints file reinstalls.
stamp=.venv/.automodel-installed
want="$variant ${torch_args[*]} pyproject=$(sha256sum pyproject.toml | cut -c1-16) constraints=$(sha256sum scripts/constraints.txt | cut -c1-16)"
have=$(cat "$stamp" 2>/dev/null || echo none)
if [ -z "$have" ] && [ "$variant" != custom ]; then
  # an empty stamp: written by the earlier setup.sh, which recorded nothing. Current if the
  # installed torch is the build chosen now; then it is only rewritten in the new form.
  installed=$(sed -n "s/^__version__ = '\(.*\)'/\1/p" \
    .venv/lib/python3*/site-packages/torch/version.py 2>/dev/null | head -n 1)
  if [ "$installed" = "$TORCH_VERSION+$variant" ]; then
    have=$want
    $dry_run || echo "$want" >"$stamp"
  fi
fi

if $dry_run; then
  echo "torch: $variant ($why)"
  echo "pip install ${torch_args[*]}"
  if [ "$have" = "$want" ]; then echo "stamp: up to date, nothing to install"
  else echo "stamp: '$have' -> would install '$want'"; fi
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if [ "$have" != "$want" ]; then
  echo "scripts/setup.sh: installing torch $variant ($why)"
  pip=(.venv/bin/python -m pip install -q)
  "${pip[@]}" --upgrade pip
  if [ "$variant" = cpu ]; then
    # pip's configured sources first (a local wheel cache or mirror); PyPI has no "+cpu"
    # builds, so then PyTorch's CPU index
    "${pip[@]}" "${torch_args[@]}" 2>/dev/null \
      || "${pip[@]}" "${torch_args[@]}" --extra-index-url "$TORCH_INDEX/cpu"
  else
    "${pip[@]}" "${torch_args[@]}"
  fi
  "${pip[@]}" -c scripts/constraints.txt -e ".[test,megatron]"  # (the tested versions)
  echo "$want" >"$stamp"
fi
