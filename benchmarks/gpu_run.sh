#!/usr/bin/env bash
# One device call: the GPU kernel tests and benchmark, the host-read test, the compile tests on this torch, cold/warm compile time, the optimizer phase's host time (update), NCCL equivalence, the head-to-head table,
# the CPU Adam benchmark, the single-GPU table and the largest-model runs (PARTS picks; TAG names a repeat;
# PROFILE=1 or CPROFILE=1 profiles 3 extra steps of each contender, after its timed steps; OFFLOAD_THREADS=N
# gives the offload contenders N host-update threads).
# Logs go to $OUT (or ./gpu_out). Usage on the GPU machine:
#   bash benchmarks/gpu_run.sh [medium] [steps]
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
MODEL=${1:-medium}; STEPS=${2:-20}; PARTS=${PARTS:-kernels,equiv,table,cpuadam,single}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/machine.txt"
python3 -c "import torch, numba, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'numba', numba.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/machine.txt"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
# torchrun would give every process OMP_NUM_THREADS=1, starving every CPU optimizer (ours and
# DeepSpeed's) alike: give each rank its share of the cores instead.
export OMP_NUM_THREADS=$(( $(nproc) / (NGPU > 0 ? NGPU : 1) ))
run() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v "Warning\|warn(" ; }
if [[ $PARTS == *kernels* ]]; then
  # (CPU-side tests that fork ranks are left to CI: after a CUDA backward in the same process, fork is unsafe)
  run kernel_tests 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_adam.py tests/test_cpu_adam.py
  run gpu_adam 180 python3 benchmarks/gpu_adam.py --json "$OUT/gpu_adam.json"
fi
if [[ $PARTS == *update* ]]; then
  # The optimizer phase: one launch over all units (tests on the GPU, bit for bit against the per-run kernel),
  # then its host and GPU time per stack (GPT-2 medium's real widths; the tiny-width run for the CPU's numbers).
  run update_tests 240 python3 -m pytest -q -p no:cacheprovider tests/test_fused_plan.py tests/test_gpu_adam.py -k "cuda or sm90"
  run update_medium 240 python3 benchmarks/update_host_time.py --device cuda --medium --steps 30
  run update_tiny 120 python3 benchmarks/update_host_time.py --device cuda --steps 30
fi
if [[ $PARTS == *gputests* ]]; then
  # The CUDA tests of the fused plan, the GPU Adam and the graphed update alone (the update part's tests, no benchmark).
  run gpu_tests ${GPUTESTS_LIMIT:-120} python3 -m pytest -q -p no:cacheprovider tests/test_fused_plan.py \
    tests/test_gpu_adam.py tests/test_update_graph.py -k "cuda or sm90"
fi
if [[ $PARTS == *hostreads* ]]; then
  # Issue #25's test on the GPU: no host read in a steady-state step of any stack (set_sync_debug_mode("error")).
  run host_reads ${HOSTREADS_LIMIT:-180} python3 tests/gpu/host_reads.py
fi
if [[ $PARTS == *compiletests* ]]; then
  # The compile tests on this machine's torch (the CUDA build users install; CPU CI runs 2.13), on the CPU here:
  # the traced path must trace on both. (Forked ranks: run before any CUDA work in the process.)
  run compile_tests ${COMPILETESTS_LIMIT:-240} env CUDA_VISIBLE_DEVICES= python3 -m pytest -q -p no:cacheprovider \
    tests/test_compile_trace_cost.py tests/test_compile.py -k "${COMPILETESTS_K:-world_1 or bounded or gathers_nothing or refus or guard}"
fi
if [[ $PARTS == *compiletime* ]]; then
  # Cold and warm compile of each contender in fresh processes, against the floor's in the same call.
  (cd benchmarks && run compile_time_$MODEL${TAG:-} ${COMPILETIME_LIMIT:-300} python3 compile_time.py --model "$MODEL" \
    --seq 1024 --micro-batch 8 --contenders "${COMPILE_CONTENDERS:-floor,zfunc-s3-compiled}" --json "$OUT/compile_time.json")
fi
if [[ $PARTS == *equiv* ]]; then
  run equiv ${EQUIV_LIMIT:-240} torchrun --nproc-per-node "$NGPU" tests/gpu/nccl_equivalence.py
fi
if [[ $PARTS == *gradtiers* ]]; then
  run grad_tiers ${GRADTIERS_LIMIT:-240} python3 tests/gpu/grad_tiers.py
fi
if [[ $PARTS == *cpuadam* ]]; then
  run cpuadam 120 python3 benchmarks/cpu_adam.py --numel 100000000 --repeats 5 --json "$OUT/cpuadam.json"
fi
if [[ $PARTS == *table* ]] && [ "$NGPU" -ge 2 ]; then
  run table_$MODEL${TAG:-} ${TABLE_LIMIT:-400} torchrun --nproc-per-node 2 benchmarks/gpt_zero.py --model "$MODEL" \
    --steps "$STEPS" --json "$OUT/table_$MODEL${TAG:-}.json" ${CONTENDERS:+--contenders $CONTENDERS} \
    ${PROFILE:+--profile} ${CPROFILE:+--cprofile}
fi
if [[ $PARTS == *largest* ]]; then
  # One process per size and contender (benchmarks/largest_model.py supervises them); the NVMe tier and
  # DeepSpeed's NVMe offload use $NVME_DIR.
  run largest${TAG:-} ${LARGEST_LIMIT:-580} python3 benchmarks/largest_model.py --sizes "${LARGEST_SIZES:-2.7b}" \
    --contenders "${LARGEST_CONTENDERS:-zfunc,zfunc-host,deepspeed,fsdp2}" --steps "${LARGEST_STEPS:-2}" \
    --tokens-per-step "${LARGEST_TOKENS:-32768}" --micro-batch "${LARGEST_MB:-8}" --nvme-dir "${NVME_DIR:-/tmp/zfunc-nvme}" \
    --limit-s "${LARGEST_RUN_LIMIT:-400}" --json "$OUT/largest${TAG:-}.json" ${LARGEST_EXTRA:-}
fi
if [[ $PARTS == *regather* ]]; then
  # zf.compile_step's regather pass: its CPU tests on this machine's torch (gloo and the fake process group;
  # run before any CUDA work in their own process), the peak of one stage-3 step on the GPU as rank 0 of 2
  # simulated ranks (torch's fake process group: one GPU measures a rank of a larger world) with and without
  # the pass, and GPT-2's whole-step compile on one GPU with the pass (a no-op at one rank: it checks that
  # the step compiles and runs with it; REGATHER_MODEL=medium for the table's model, a compile of minutes).
  run regather_tests ${REGATHER_LIMIT:-300} python3 -m pytest -q -p no:cacheprovider tests/test_compile_regather.py
  run regather_memory 300 python3 benchmarks/compile_memory.py --backend inductor --device cuda --world 2 \
    --width 4096 --blocks 12
  run regather_single 500 torchrun --nproc-per-node 1 benchmarks/gpt_zero.py --model "${REGATHER_MODEL:-tiny}" \
    --steps "$STEPS" --contenders zfunc-s3-compiled,zfunc-s3-regather
fi
if [[ $PARTS == *single* ]]; then
  run single_$MODEL${TAG:-} ${SINGLE_LIMIT:-300} torchrun --nproc-per-node 1 benchmarks/gpt_zero.py --model "$MODEL" --steps "$STEPS" \
    --contenders ${SINGLE_CONTENDERS:-floor,zfunc-s1,zfunc-s2,zfunc-s3,zfunc-s3-checkpoint,zfunc-s2-offload,zfunc-s3-offload,fsdp2,ds-z2,ds-z3,ds-z2-offload} \
    --json "$OUT/single_$MODEL${TAG:-}.json" ${PROFILE:+--profile} ${CPROFILE:+--cprofile} \
    ${OFFLOAD_THREADS:+--offload-threads "$OFFLOAD_THREADS"} ${HOSTPROBE:+--host-probe} ${WARMUP:+--warmup "$WARMUP"}
fi
