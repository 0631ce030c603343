#!/usr/bin/env bash
# One run on a lent GPU (the device tool): install the carried wheels (.whl: pyzmq, lmdb
# for the machine's Python) and hicache itself, then run the given benchmarks, writing
# their JSON to $OUT. Usage: bash benchmarks/gpu_round.sh data_plane [ttft] [headline] [restart] [layerwise] ...
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . >/dev/null
nvidia-smi --query-gpu=name,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader
out="${OUT:-/tmp/out}"
mkdir -p "$out"
for what in "$@"; do
    case "$what" in
        data_plane) python3 benchmarks/bench_data_plane.py --device cuda --json "$out/data_plane.json" ;;
        ttft) python3 benchmarks/hf_ttft_gpu.py --json "$out/ttft.json" ;;
        headline) python3 benchmarks/hf_ttft_gpu.py --headline 10240:16,64:20 --json "$out/headline.json" ;;
        restart) python3 benchmarks/hf_ttft_gpu.py --skip-loadback --models llama,bamba \
            --lengths 4096 --restart-disk-hit --json "$out/restart.json" ;;
        layerwise) python3 benchmarks/hf_ttft_gpu.py --skip-loadback --models llama-8b,bamba \
            --lengths 8192,32768 --hit-fraction 0.5,0.9 --requests 5 --json "$out/layerwise.json" ;;
        data_plane_quick) python3 benchmarks/bench_data_plane.py --device cuda \
            --sizes-mib 1,64,1024 --repeat 3 --json "$out/data_plane.json" ;;
        *) echo "unknown: $what" >&2; exit 2 ;;
    esac
done
