#!/usr/bin/env bash
# One run on a lent GPU (the device tool): install the carried wheels (.whl: pyzmq, lmdb
# for the machine's Python) and hicache itself, then run the given benchmarks, writing
# their JSON to $OUT; one that fails is reported and the next still runs. Usage:
#   bash benchmarks/gpu_round.sh data_plane [ttft] [headline] [restart] [layerwise] [cost_rule] ...
# (data_plane_ab times a base beside this code: `git archive -o .whl/before.tar BASE` first)
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . >/dev/null || exit 1
nvidia-smi --query-gpu=name,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader
out="${OUT:-/tmp/out}"
mkdir -p "$out"

# bench_data_plane.py with ARGS, a base (.whl/before.tar, from `git archive BASE`) and this
# code taking turns, twice: ab_turns NAME ARGS...
install_base() {
    rm -rf /tmp/before /tmp/before-site && mkdir -p /tmp/before &&
        tar -xf .whl/before.tar -C /tmp/before &&
        python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir \
            --target /tmp/before-site /tmp/before >/dev/null
}
ab_turns() {
    local name=$1 turn
    shift
    install_base || return 1
    for turn in 1 2; do
        echo "== base, turn $turn"
        PYTHONPATH=/tmp/before-site:/tmp/site python3 benchmarks/bench_data_plane.py \
            --device cuda "$@" --json "$out/${name}_base_$turn.json" || return 1
        echo "== this code, turn $turn"
        python3 benchmarks/bench_data_plane.py --device cuda "$@" \
            --json "$out/${name}_now_$turn.json" || return 1
    done
}
for what in "$@"; do
    case "$what" in
        data_plane) python3 benchmarks/bench_data_plane.py --device cuda --json "$out/data_plane.json" ;;
        ttft) python3 benchmarks/hf_ttft_gpu.py --json "$out/ttft.json" ;;
        headline) python3 benchmarks/hf_ttft_gpu.py --headline 10240:16,64:20 --json "$out/headline.json" ;;
        restart) python3 benchmarks/hf_ttft_gpu.py --skip-loadback --models llama,bamba \
            --lengths 4096 --restart-disk-hit --json "$out/restart.json" ;;
        layerwise) python3 benchmarks/hf_ttft_gpu.py --skip-loadback --models llama-8b,bamba \
            --lengths 8192,32768 --hit-fraction 0.5,0.9 --requests 5 --json "$out/layerwise.json" ;;
        layerwise_8b) python3 benchmarks/hf_ttft_gpu.py --skip-loadback --models llama-8b \
            --lengths 8192,32768 --hit-fraction 0.5,0.9 --requests 3 --json "$out/layerwise_8b.json" ;;
        layerwise_copies) python3 benchmarks/hf_ttft_gpu.py --skip-loadback --models llama-8b \
            --lengths 8192,32768 --hit-fraction 0.5,0.9 --requests 3 --layer-copies dma,16,0 \
            --json "$out/layerwise_copies.json" ;;
        layerwise_16) python3 benchmarks/hf_ttft_gpu.py --skip-loadback --models llama-8b \
            --lengths 8192,32768 --hit-fraction 0.5,0.9 --requests 3 --layer-copies 16 \
            --json "$out/layerwise_16.json" ;;
        layerwise_rows) python3 benchmarks/hf_ttft_gpu.py --skip-loadback --models llama-8b \
            --lengths 8192,32768 --hit-fraction 0.5,0.9 --requests 3 --layer-copies dma,16 \
            --json "$out/layerwise_rows.json" ;;
        layerwise_dma) python3 benchmarks/hf_ttft_gpu.py --skip-loadback --models llama-8b \
            --lengths 8192,32768 --hit-fraction 0.5,0.9 --requests 3 --layer-copies dma \
            --json "$out/layerwise_dma.json" ;;
        layerwise_ahead) python3 benchmarks/hf_ttft_gpu.py --skip-loadback --models llama-8b \
            --lengths 8192,32768 --hit-fraction 0.9 --requests 3 --layer-copies queued \
            --json "$out/layerwise_ahead.json" ;;
        layerwise_timeline) python3 benchmarks/hf_ttft_gpu.py --skip-loadback --models llama-8b \
            --lengths 8192,32768 --hit-fraction 0.9 --requests 3 --timeline \
            --json "$out/layerwise_timeline.json" ;;
        layerwise_timeline_8k) python3 benchmarks/hf_ttft_gpu.py --skip-loadback --models llama-8b \
            --lengths 8192 --hit-fraction 0.9 --requests 1 --timeline \
            --json "$out/layerwise_timeline_8k.json" ;;
        layerwise_hybrid) python3 benchmarks/hf_ttft_gpu.py --skip-loadback --models bamba \
            --lengths 8192 --hit-fraction 0.5,0.9 --requests 3 --json "$out/layerwise_hybrid.json" ;;
        restart_disk) python3 benchmarks/bench_restart.py --device cuda \
            --json "$out/restart_disk.json" ;;
        restart_stacks) python3 benchmarks/bench_restart.py --device cuda --sizes-kib 256,4096 \
            --total-mib 256 --repeat 2 --sample-stacks --json "$out/restart_stacks.json" ;;
        page_ops) python3 benchmarks/bench_page_ops.py --rounds 9 --json "$out/page_ops.json" ;;
        cost_rule) python3 benchmarks/bench_cost_rule.py --device cuda --prefix 4096 \
            --host-mib 4096 --json "$out/cost_rule.json" ;;
        gpu_tests)  # the tests marked gpu, against the installed hicache (not the checkout's)
            rm -rf /tmp/gt && mkdir -p /tmp/gt && cp -r tests benchmarks pyproject.toml /tmp/gt/ &&
                (cd /tmp/gt && timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
                    $(grep -rl "mark.gpu" tests) 2>&1 | tail -40) ;;
        data_plane_quick) python3 benchmarks/bench_data_plane.py --device cuda \
            --sizes-mib 1,64,1024 --repeat 3 --json "$out/data_plane.json" ;;
        data_plane_ab) ab_turns data_plane --sizes-mib 1,64,1024 --repeat 3 ;;
        headline_ab)  # the headline of a base (.whl/before.tar) and of this code, one machine
            # (run from /tmp: the checkout's hicache/ must not shadow either in the sidecar)
            here=$PWD
            install_base && (cd /tmp &&
                PYTHONPATH=/tmp/before-site:/tmp/site python3 "$here/benchmarks/hf_ttft_gpu.py" \
                    --headline 10240:16,64:20 --json "$out/headline_base.json" &&
                python3 "$here/benchmarks/hf_ttft_gpu.py" --headline 10240:16,64:20 \
                    --json "$out/headline_now.json") ;;
        loadback_ab) ab_turns loadback --paths pools --sizes-mib 1,64,1024 --repeat 9 ;;
        trace_pools)  # where a one-page backup's and load-back's time goes, both sides traced
            python3 benchmarks/bench_data_plane.py --device cuda --sizes-mib 1 --paths pools \
                --repeat 15 --trace-dir /tmp/trace_pools --json "$out/trace_pools.json" ;;
        trace_pools_64)  # the same for a 64 MiB backup and load-back
            python3 benchmarks/bench_data_plane.py --device cuda --sizes-mib 64 --paths pools \
                --repeat 9 --trace-dir /tmp/trace_pools_64 --json "$out/trace_pools_64.json" ;;
        data_plane_spin) python3 benchmarks/bench_data_plane.py --device cuda \
            --sizes-mib 1,64 --repeat 5 --reply-spin-s 0.005 --json "$out/data_plane_spin.json" ;;
        probe_staged) python3 benchmarks/probe_staged.py --watchdog-s 200 \
            --json "$out/probe_staged.json" ;;
        at_once) python3 benchmarks/probe_at_once.py --json "$out/at_once.json" ;;
        at_once_staged)  # 64 MiB at once, staged (the default) and direct copies, in turns
            for turn in 1 2; do
                for mib in 16 128; do
                    echo "== staged from $mib MiB, turn $turn"
                    python3 benchmarks/probe_at_once.py --sizes-mib 64 --repeat 15 \
                        --staged-min-mib $mib --json "$out/at_once_staged_${mib}_$turn.json"
                done
            done ;;
        probe_launch) python3 benchmarks/probe_launch.py --json "$out/probe_launch.json" ;;
        sweep_tuning) python3 benchmarks/sweep_copy_tuning.py --json "$out/sweep_tuning.json" ;;
        data_plane_spy)  # the 64 MiB paths with the bench and its sidecar sampled (py-spy wheel in .whl)
            /tmp/site/bin/py-spy record --subprocesses --idle --threads -r 250 -f raw \
                -o "$out/data_plane_spy.txt" -- python3 benchmarks/bench_data_plane.py \
                --device cuda --sizes-mib 64 --repeat 20 --json "$out/data_plane_spy.json" ;;
        *) echo "unknown: $what" >&2; exit 2 ;;
    esac
    rc=$?
    # one that fails is reported, and the next still runs
    if [ "$rc" -ne 0 ]; then echo "FAILED: $what (exit $rc)" >&2; failed=1; fi
done
exit "${failed:-0}"
