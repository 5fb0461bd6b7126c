#!/usr/bin/env bash
# Build the wheelhouse that scripts/gpu-check.sh installs from, on a machine WITH a
# package registry, for a GPU machine WITHOUT one (CPython 3.12, x86-64, CUDA torch
# already installed there). Only what that machine lacks is fetched: the project's
# pure-Python and small binary dependencies, never torch.
#
#   scripts/gpu-wheels.sh [WHEELHOUSE]      # default: .whl (keep it out of git)
#
# The versions are those the project is tested with; the GPU machine's own
# numpy, torch, transformers, huggingface-hub, pytest, hypothesis, httpx and
# scikit-learn are used as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
wheelhouse=${1:-.whl}
python=${PYTHON:-python3}
packages=(
    # runtime
    transitions==0.9.3 msgspec==0.23.0 pyzmq==27.3.0 typing_extensions==4.16.0
    # the diffusers extra (transformers comes with the GPU machine)
    diffusers==0.42.1 importlib_metadata==10.2.0 lazy-importer==0.1.0
    # the serve extra and the test extra's clients
    fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5
    annotated-types==0.8.0 typing-inspection==0.4.5 opentelemetry-api==1.45.2
    uvicorn==0.54.0 openai==3.57.0 jiter==0.19.0 sniffio==1.3.1
    httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
    # the import-layer test
    import-linter==2.17 grimp==3.20
)
mkdir -p "$wheelhouse"
"$python" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any \
    -d "$wheelhouse" "${packages[@]}"
du -sh "$wheelhouse"
ls "$wheelhouse"
