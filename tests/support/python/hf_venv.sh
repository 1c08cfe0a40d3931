#!/usr/bin/env bash
# A virtual environment with Hugging Face's clients for the tests that check Troupe's
# exports with them (tests/integration/hf_client_test.cpp). It sees Debian's packages
# (--system-site-packages: python3-torch 1.13 serves) and adds, from Python's package
# registry, versions that work with torch 1.13:
#   transformers 4.44.2, safetensors 0.4.5 (and what they pull in)
# (About 20 MB of wheels, downloaded again for each build folder: pip's HTTP cache keeps
# nothing where the registry is reached through a proxy that strips caching headers.)
# transformers 5 over torch 2: hf5_venv.sh.
#
#   tests/support/python/hf_venv.sh DIR    make DIR (once) and print its python
# Exit 77 (CTest's skip) with a message when the registry cannot be reached.
set -uo pipefail
dir=${1:?usage: hf_venv.sh DIR}
py="$dir/bin/python"
# Tests run in parallel may ask for the same DIR: one makes it, the others wait.
mkdir -p "$(dirname "$dir")" && exec 9>"$dir.lock" && command -v flock >/dev/null && flock 9
if [ -x "$py" ] && "$py" -c "import transformers, safetensors" 2>/dev/null; then
  echo "$py"
  exit 0
fi
rm -rf "$dir"
/usr/bin/python3 -m venv --system-site-packages "$dir" >&2 || { echo "hf_venv: python3 -m venv failed (apt-get install python3-venv)" >&2; exit 77; }
if ! "$dir/bin/pip" install -q --disable-pip-version-check "transformers==4.44.2" "safetensors==0.4.5" >&2; then
  echo "hf_venv: cannot install transformers and safetensors from Python's package registry: skipped" >&2
  rm -rf "$dir"
  exit 77
fi
echo "$py"
