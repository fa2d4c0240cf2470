#!/usr/bin/env bash
# Load a GGUF export in llama.cpp itself and compare it with our model on the shipped val text, then sample.
#   bash lab/check_llamacpp.sh --ckpt=out/stage2/ckpt.pt [--windows=16 --samples=3 --out=results/llamacpp.json]
# Installs llama-cpp-python 0.3.36 first if it is missing (not for --help): pip compiles its bundled llama.cpp
# from source (CPU only; expect tens of minutes on 2 cores). Not part of the test suite for that reason;
# tests/test_gguf.py checks the file.
set -euo pipefail
cd "$(dirname "$0")/.."
case " $* " in *" --help "*|*" -h "*) exec python -m lab.check_llamacpp "$@" ;; esac  # no install for --help
python -c "import llama_cpp" 2>/dev/null || pip install "llama-cpp-python==0.3.36"
python -m lab.check_llamacpp "$@"
