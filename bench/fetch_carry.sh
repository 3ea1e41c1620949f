#!/usr/bin/env bash
# What a lent GPU machine (torch and Triton, Python 3.12, no package registry) needs beyond them
# for bench/gpu_check.sh, gathered into bench/carry/ (git ignores it; about 26 MiB of the 64 a
# device call may bring along):
#   wheels/   megatron-core 0.16.1 (the MoE capture signal, the pipeline schedules), nvtx, pyyaml,
#             numpy, packaging, pytest with what it needs (the cuda tests), and pydantic with what
#             it needs (TransformerEngine's recipes, which its graph.py imports)
#   peers/    TransformerEngine's pure-Python wheel (1.2 MB), whose graph.py (graph.backend te,
#             megatron's helper) and mHC kernels (the peers part) are loaded by path: never pip
#             install it there (import transformer_engine would then raise)
#   megatron-lm-{main,dev}-*.tar.gz   the Megatron-LM snapshots the megatron and peers parts run
# Run it from the repository root on a machine that reaches PyPI:  bench/fetch_carry.sh
set -euo pipefail
PY=${PYTHON:-python3}
CARRY=bench/carry
mkdir -p "$CARRY/wheels"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$CARRY/wheels" \
    megatron-core==0.16.1 nvtx pyyaml numpy packaging pytest pluggy iniconfig pygments \
    pydantic pydantic-core annotated-types typing-inspection typing-extensions
mkdir -p "$CARRY/peers"
"$PY" -m pip download -q --no-deps -d "$CARRY/peers" transformer-engine==2.20.2
for branch in main dev; do
    snapshot=$(ls ${MHC_CG_THIRD_PARTY:-../shared/third_party}/megatron-lm-$branch-*.tar.gz | tail -n 1)
    cp "$snapshot" "$CARRY/"
done
du -sh "$CARRY"
