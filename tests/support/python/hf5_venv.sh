#!/usr/bin/env bash
# A virtual environment with transformers 5 for the tests that check Troupe against it.
# Unlike hf_venv.sh it does not see Debian's packages (python3-torch 1.13 would shadow
# torch 2): everything comes from Python's package registry, pinned:
#   torch 2.15.0, transformers 5.24.0, safetensors 0.8.0, numpy 2.4.6 (and what they pull in);
#   and the data clients: megatron-core 0.16.1 (its indexed_dataset imports without a GPU),
#   sentencepiece 0.2.1 and protobuf 7.36.2 (AutoTokenizer's reader of a lone tokenizer.model)
# PyPI's Linux torch pulls the nvidia-* CUDA wheels: about 2.9 GB to download, 5.6 GB installed.
# (torch --no-deps does not import: libtorch links against cuDNN, cuBLAS, NCCL, ...)
# pip's HTTP cache keeps nothing where the registry is reached through a proxy that strips
# caching headers, so the wheels are kept in a folder of pip's cache
# (~/.cache/pip/troupe-hf5-wheels): only a fresh machine downloads them.
#
#   tests/support/python/hf5_venv.sh DIR    make DIR (once) and print its python
# Exit 77 (CTest's skip) with a message when the registry cannot be reached.
set -uo pipefail
dir=${1:?usage: hf5_venv.sh DIR}
py="$dir/bin/python"
pkgs=("torch==2.15.0" "transformers==5.24.0" "safetensors==0.8.0" "numpy==2.4.6")
extras=("megatron-core==0.16.1" "sentencepiece==0.2.1" "protobuf==7.36.2")
wheels=${PIP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pip}/troupe-hf5-wheels
ok() { [ -x "$py" ] && "$py" -c "import torch, transformers, safetensors, numpy
assert transformers.__version__.split('.')[0] == '5'" 2>/dev/null; }
extras_ok() { "$py" -W ignore -c "import sentencepiece, google.protobuf
from megatron.core.datasets.indexed_dataset import IndexedDataset" >/dev/null 2>&1; }
# The data clients, into an environment that has the rest (one made before they were added
# keeps its torch): from the kept wheels, downloaded first where missing.
add_extras() {
  extras_ok && return 0
  local pip=("$dir/bin/pip" install -q --disable-pip-version-check)
  if ! "${pip[@]}" --no-index --find-links "$wheels" "${extras[@]}" >/dev/null 2>&1; then
    "$dir/bin/pip" download -q --disable-pip-version-check -d "$wheels" "${extras[@]}" >&2 ||
      keep_skip "cannot download megatron-core and sentencepiece from Python's package registry"
    "${pip[@]}" --no-index --find-links "$wheels" "${extras[@]}" >&2 || keep_skip "pip install of the data clients failed"
  fi
  extras_ok || keep_skip "megatron-core or sentencepiece does not import"
}
skip() { echo "hf5_venv: $1: skipped" >&2; rm -rf "$dir"; exit 77; }
keep_skip() { echo "hf5_venv: $1: skipped" >&2; exit 77; }  # (the environment itself is sound)
# Tests run in parallel may ask for the same DIR: one makes it, the others wait.
mkdir -p "$(dirname "$dir")" && exec 9>"$dir.lock" && command -v flock >/dev/null && flock 9
if ok; then add_extras; echo "$py"; exit 0; fi
rm -rf "$dir"
/usr/bin/python3 -m venv "$dir" >&2 || skip "python3 -m venv failed (apt-get install python3-venv)"
pip=("$dir/bin/pip" install -q --disable-pip-version-check)
# From the kept wheels if they are all there; otherwise download them first.
if ! "${pip[@]}" --no-index --find-links "$wheels" "${pkgs[@]}" >/dev/null 2>&1; then
  mkdir -p "$wheels" || skip "cannot make $wheels"
  "$dir/bin/pip" download -q --disable-pip-version-check -d "$wheels" "${pkgs[@]}" >&2 ||
    skip "cannot download torch and transformers from Python's package registry"
  "${pip[@]}" --no-index --find-links "$wheels" "${pkgs[@]}" >&2 || skip "pip install failed"
fi
ok || skip "torch or transformers 5 does not import"
add_extras
echo "$py"
