#!/bin/bash
# make gpu-check on a lent machine that cannot install (docs/gpu-check.md), each step bounded by `timeout`
# and run on after a failure, so that one short lease gives every figure it can: GPU_TESTS, PYTEST_S (seconds
# for the tests) and STEPS ("name:seconds ...") choose what runs; the log and bench/results go to $OUT.
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
OUT=$(realpath "${OUT:-.}"); LOG=$OUT/gpu-check.txt
T0=$(date +%s) FAIL=0
step() { local t=$1; shift; echo "=== [$(( $(date +%s) - T0 ))s] $*" | tee -a $LOG; timeout -k 5 $t "$@" 2>&1 | tee -a $LOG; local rc=${PIPESTATUS[0]}; echo "=== rc=$rc" | tee -a $LOG; [ $rc = 0 ] || FAIL=1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD LORAPLEX_CACHE=/tmp/loraplex
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)" | tee $LOG
python3 -m bench.tiny_model .gpu/shape $LORAPLEX_CACHE/models/SmolLM2-135M-Instruct >/dev/null || exit 8
TESTS="${GPU_TESTS:-tests/kernels/test_backends.py tests/kernels/triton tests/engine/test_backend_fidelity.py tests/engine/lora/test_distinct_adapters.py tests/engine/lora/test_page_copier.py tests/engine/test_sampler.py tests/engine/model/test_families.py tests/engine/model/test_expert_lora.py tests/engine/lora/test_compose.py tests/engine/lora/test_dora.py}"
LORAPLEX_TEST_DEVICE=cuda step ${PYTEST_S:-200} python3 -m pytest -q -p no:cacheprovider --timeout 100 -rfE --durations 8 $TESTS
for s in ${STEPS:-serve_check:45 bench_engine:60 bench_peft:75 bench_coldstart:35 bench_lora:30 bench_attention:25}; do
  n=${s%%:*}; t=${s##*:}; a="--device cuda"; [ $n = bench_engine ] && a="$a --repeats 3"; [ $n = bench_peft ] && a="$a --experiment peft"
  step $t python3 -m bench.$n $a
done
(cd bench/results 2>/dev/null && tar czf $OUT/results.tgz .)
echo "total $(( $(date +%s) - T0 ))s" | tee -a $LOG
exit $FAIL
