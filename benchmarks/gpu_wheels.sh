#!/usr/bin/env bash
# Downloads into .whl/ the wheels the device machine lacks (Python 3.12, x86-64): xgrammar and what
# it imports there (apache-tvm-ffi, pydantic and its parts, a new enough typing-extensions) and a
# grpcio new enough for the generated stubs, with its health and reflection services.
# benchmarks/run_list.sh installs them; a device call carries `.whl`.
set -eu
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 typing-extensions==4.16.0 \
    grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
ls .whl
