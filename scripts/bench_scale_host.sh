#!/bin/sh
# `make bench-scale` on a many-core host with no network and no Paddle, from the repository
# root: the wheels `make bench-scale-kit` put in .whl/ go into a folder of their own (the
# host's Python is left as it is), and the run serves mlp_numpy, a Python-backend model of
# mlp's shapes. Results go to $OUT (default bench-results/): scale.json, scale.txt and, where
# NVML sees GPUs, topology.txt. The generated protobuf modules must be there (`make proto`).
# FRONTENDS, CLIENTS (default: half the cores) and DURATION size the run.
set -eu
out=${OUT:-bench-results}
site=${SITE:-/tmp/paddlequic-site}
python=${PYTHON:-python3}
mkdir -p "$out"
"$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1
"$python" -m clients.cli topology > "$out/topology.txt" 2>&1 || echo "no topology: see $out/topology.txt"
"$python" -m scripts.bench_scale --model mlp_numpy --frontends "${FRONTENDS:-1,2,4,8}" \
    --duration "${DURATION:-3}" ${CLIENTS:+--clients "$CLIENTS"} --out "$out/scale.json" \
    | tee "$out/scale.txt"
