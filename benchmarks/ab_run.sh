#!/bin/bash
# A/B of two versions of zfunc on one GPU, same benchmark script, same machine, interleaved rounds:
# "new" is this working tree's zfunc, "base" the zfunc package in $BASE. Make the baseline with
#   mkdir -p .baseline/base && git archive <commit> zfunc | tar -x -C .baseline/base
# and carry .baseline (and .whl) to the device. Optional: the NCCL equivalence first (EQ seconds, 0: skip).
#   EQ=200 ROUNDS=2 C=zfunc-s1,zfunc-s3 NPROC=1 bash benchmarks/ab_run.sh   (NPROC: GPUs, one rank each)
# Logs and JSON go to $OUT (ab_<new|base>_<round>.*, equiv.log).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
ROOT=$PWD BASE=${BASE:-$PWD/.baseline/base} OUT=${OUT:-/tmp/ab}
mkdir -p "$OUT"
SITE=/tmp/site
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .whl/*.whl
fi
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/machine.txt"
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" >> "$OUT/machine.txt"
if [ "${EQ:-200}" != 0 ]; then
  PYTHONPATH=$ROOT:$SITE timeout "${EQ:-200}" torchrun --nproc-per-node 1 tests/gpu/nccl_equivalence.py > "$OUT/equiv.log" 2>&1
  echo "equiv rc $?" >> "$OUT/equiv.log"
  tail -5 "$OUT/equiv.log"
fi
for round in $(seq 1 "${ROUNDS:-2}"); do
  for tree in new base; do
    if [ $tree = new ]; then P=$ROOT; else P=$BASE; fi
    echo "== round $round $tree"
    PYTHONPATH=$P:$SITE timeout "${AB:-110}" torchrun --nproc-per-node "${NPROC:-1}" benchmarks/gpt_zero.py --model "${MODEL:-medium}" \
      --steps "${STEPS:-20}" --contenders "${C:-zfunc-s1,zfunc-s3}" --json "$OUT/ab_${tree}_${round}.json" \
      > "$OUT/ab_${tree}_${round}.log" 2>&1
    grep -E "^(floor|zfunc|fsdp|ds-)" "$OUT/ab_${tree}_${round}.log"
  done
done
