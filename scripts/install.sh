#!/usr/bin/env bash
# Install spac into ./.venv: the patched llama.cpp (scripts/build_native.py) and the package.
#   scripts/install.sh            runtime only
#   scripts/install.sh --test     plus what the test suite needs
# Any other argument goes to build_native.py (e.g. --cuda --cuda-arch 86). Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
build_args=()
for arg in "$@"; do
    case "$arg" in
        --test) extras="[test]" ;;
        *) build_args+=("$arg") ;;
    esac
done

[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "scikit-build-core>=0.9.2"
.venv/bin/python scripts/build_native.py ${build_args[@]+"${build_args[@]}"}
# llama-cpp-python==0.3.36 is already satisfied by the build above, so pip keeps ours
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extras}"
