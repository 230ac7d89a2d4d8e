#!/usr/bin/env bash
# One device call: GPU tests, then the benchmarks, logs and JSON under $OUT.
# Usage (on the GPU machine, repo root): bash benchmarks/run_device.sh [tests|tests-all|tests-NAME|cast|gemm|solve|net|convbwd|chunk|tune-gemm|tune-convfwd|tune-tma|tune-wgrad|tune-flat|tune-splitk ...]
# (product suites run `tcprec bench <suite>`; net: NET_ARGS for tcprec bench net; tune-wgrad / tune-flat: TUNE_ARGS for
#  benchmarks/tune_wgrad_{tma,flat}_device.py, e.g. "--layers 2,6".  See benchmarks/README.md.)
set -uo pipefail
export PYTHONUNBUFFERED=1 TCPREC_CACHE_DIR="${TCPREC_CACHE_DIR:-/tmp/tcache}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # carried wheels (qtorch for the cast baseline)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="src:/tmp/site"
else
    export PYTHONPATH=src
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for step in "${@:-tests cast}"; do
    case "$step" in
        tests) timeout 300 python3 -m pytest -q tests/gpu -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
        tests-all)  # every GPU test file alone, 3 xdist workers (needs .carry/whl: pytest-xdist), per-file time limit
            python3 -m pip install -q --no-deps --no-index .carry/whl/*.whl 2>/dev/null
            for f in tests/gpu/test_*_gpu.py; do  # one log file (the device returns at most 8 files)
                timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q "$f" -p no:cacheprovider -n 3 > /tmp/t.log 2>&1
                echo "$(basename "$f" .py) rc=$?: $(tail -1 /tmp/t.log)" | tee -a "$OUT/gpu_tests_all.log"
                grep -E "^(FAILED|ERROR)" /tmp/t.log | tee -a "$OUT/gpu_tests_all.log" | head -10
            done ;;
        tests-*) timeout 300 python3 -m pytest -q "tests/gpu/test_${step#tests-}_gpu.py" -p no:cacheprovider --durations=5 2>&1 \
                 | tee "$OUT/gpu_tests_${step#tests-}.log" | tail -25 ;;
        cast) timeout 240 python3 -m tcprec.cli bench cast 2>&1 | tee "$OUT/bench_cast.log" | tail -40
              cp benchmarks/results/cast.json "$OUT/" 2>/dev/null ;;
        gemm) timeout 540 python3 -m tcprec.cli bench gemm 2>&1 | tee "$OUT/bench_gemm.log" | tail -40
              cp benchmarks/results/gemm.json "$OUT/" 2>/dev/null ;;
        solve) timeout 540 python3 -m tcprec.cli bench solve 2>&1 | tee "$OUT/bench_solve.log" | tail -60
               cp benchmarks/results/solve.json "$OUT/" 2>/dev/null ;;
        net) timeout 560 python3 -m tcprec.cli bench net ${NET_ARGS:-} 2>&1 | tee "$OUT/bench_net.log" | tail -120
             cp benchmarks/results/net.json benchmarks/results/net.png "$OUT/" 2>/dev/null ;;
        transformer) timeout 560 python3 -m tcprec.cli bench transformer ${XF_ARGS:-} 2>&1 | tee "$OUT/bench_transformer.log" \
                     | tail -60; cp benchmarks/results/transformer.json "$OUT/" 2>/dev/null ;;  # XF_ARGS: e.g. --breakdown
        chunk) TRITON_CACHE_DIR=/tmp/tc timeout "${EMU_TIMEOUT:-400}" python3 benchmarks/tune_emulate_chunk_device.py \
                 2>&1 | tee "$OUT/bench_chunk.log" | grep -v '"diag"' | tail -40 ;;
        convbwd) timeout "${CONV_TIMEOUT:-540}" python3 -m tcprec.cli bench conv-bwd --out "$OUT/conv_bwd.json" 2>&1 \
                 | tee "$OUT/conv_bwd.log" | tail -14 ;;
        tune-gemm) timeout 540 python3 benchmarks/tune_gemm_device.py --out-dir "$OUT" 2>&1 | tee "$OUT/tune_gemm.log" | tail -40 ;;
        tune-convfwd) timeout 540 python3 benchmarks/tune_conv_fwd_device.py --tune --out "$OUT/conv_fwd.json" 2>&1 \
                      | tee "$OUT/tune_convfwd.log" | tail -40 ;;
        tune-splitk) timeout 300 python3 benchmarks/tune_splitk_device.py --out "$OUT/splitk_tune.json" 2>&1 | tail -20 ;;
        tune-tma) timeout 330 python3 benchmarks/tune_dgrad_tma_device.py 2>&1 | tee "$OUT/tune_tma.log" | tail -5 ;;
        tune-wgrad) timeout "${TUNE_TIMEOUT:-540}" python3 benchmarks/tune_wgrad_tma_device.py ${TUNE_ARGS:-} 2>&1 \
                    | tee "$OUT/tune_wgrad.log" | grep -v '^{"N"' | tail -16 ;;
        tune-flat) timeout "${TUNE_TIMEOUT:-540}" python3 benchmarks/tune_wgrad_flat_device.py ${TUNE_ARGS:-} 2>&1 \
                   | tee "$OUT/tune_flat.log" | grep -v '^{"N"\|^{"layer"' | tail -30 ;;
        *) echo "unknown step $step" ;;
    esac
done
