#!/bin/sh
# `make bench-scale` on a many-core host with no network, from the repository root: the
# wheels `make bench-scale-kit` put in .whl/ go into a folder of their own (the host's Python
# is left as it is). It serves mlp where the host's Python imports Paddle, else mlp_numpy, a
# Python-backend model of mlp's shapes that names no BLS call, so it takes instance queues as
# mlp does, on both paths: the server's batcher, and the instance queues every process holding
# calls writes into. MODEL overrides.
# Results go to $OUT (default bench-results/): scale.json, scale.txt and, where NVML sees
# GPUs, topology.txt. The generated protobuf modules must be there (`make proto`).
# FRONTENDS, CLIENTS (default: half the cores), DURATION and ROUNDS (default 3) size the run;
# WORKLOADS (default: ModelInfer, ModelStreamInfer and new connections) chooses what it measures.
set -eu
out=${OUT:-bench-results}
site=${SITE:-/tmp/paddlequic-site}
python=${PYTHON:-python3}
mkdir -p "$out"
"$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1
"$python" -m clients.cli topology > "$out/topology.txt" 2>&1 || echo "no topology: see $out/topology.txt"
if "$python" -c "import paddle" > /dev/null 2>&1; then
    model=${MODEL:-mlp}
else
    model=${MODEL:-mlp_numpy}
fi
if [ "$model" = mlp_numpy ]; then
    echo "no Paddle on this host: mlp_numpy, mlp's shapes in numpy on the Python backend" \
        | tee "$out/scale.txt"
else
    : > "$out/scale.txt"
fi
"$python" -m scripts.bench_scale --model "$model" --paths batcher,queues \
    --frontends "${FRONTENDS:-1,2,4,8}" --duration "${DURATION:-3}" ${ROUNDS:+--rounds "$ROUNDS"} \
    ${CLIENTS:+--clients "$CLIENTS"} ${WORKLOADS:+--workloads "$WORKLOADS"} \
    --out "$out/scale.json" | tee -a "$out/scale.txt"
