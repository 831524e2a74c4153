#!/usr/bin/env bash
# One prepared GPU check of the Triton / FlexAttention backend (issue 31), under 8 minutes in all:
#   1. install attnopt with the gpu and dev extras on top of the CUDA torch already present
#      (never pins a torch: an unpinned resolve would keep it, a CPU pin would replace it),
#      plus the bench peers adasplash and entmax when the registry has them (optional);
#   2. pytest -m gpu: the kernels on CUDA against float64 (bf16 / fp32 tolerances in the tests);
#   3. attnopt bench --device cuda --only cuda: the rows against SDPA flash, Flex, the peers
#      (DNAS, HNAS, entmax-1.5, T5 / ALiBi through Flex, and implicit-kernel attention: IKAN and
#      MIKAN through the fused random-Fourier kernel, the causal linear mode through the scan).
# Usage: bash scripts/gpu_check.sh [--dry-run] [OUT_DIR]
#   --dry-run  on a machine without CUDA: print the steps, check the suite's logic in Triton's
#              interpreter at a tiny size (forward only), install nothing.
# Results: OUT_DIR (default gpu-check/) gets pytest.log and bench.md; the bench table is also
# printed. Each step has its own time limit (100 + 40 + 120 + 200 s) so the run stays under 8 min.
# Offline (no registry reachable): the install step falls back to PYTHONPATH=src, which needs
# triton (CUDA wheels of torch bring it), pytest and hypothesis already installed.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
OUT="${1:-gpu-check}"
mkdir -p "$OUT"
START=$(date +%s)
elapsed() { echo "[gpu_check] +$(( $(date +%s) - START )) s: $*"; }

if [[ $DRY == 1 ]]; then
  elapsed "dry run: the steps"
  echo "  pip install -e '.[gpu,dev]' (keeps the CUDA torch); pip install adasplash entmax (optional)"
  echo "  timeout 120 python -m pytest -q -m gpu tests/functional/triton"
  echo "  timeout 200 python -m attnopt bench --device cuda --only cuda --repeat 3 --out $OUT/bench.md"
  elapsed "suite logic in Triton's interpreter (N = 24, forward only)"
  TRITON_INTERPRET=1 ATTNOPT_BENCH_CUDA_SIZES=24 python -m attnopt bench --device cpu --only cuda \
    --repeat 1 --no-memory --out "$OUT/bench-dry-run.md"
  elapsed "dry run done"
  exit 0
fi

python - <<'PY'
import torch
assert torch.cuda.is_available(), "gpu_check.sh needs a CUDA device (use --dry-run elsewhere)"
print("[gpu_check]", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))
PY
TORCH_BEFORE=$(python -c "import torch; print(torch.__version__)")

elapsed "install"
PIP=(pip install -q --retries 0 --timeout 10)
if timeout 100 "${PIP[@]}" -e ".[gpu,dev]"; then
  timeout 40 "${PIP[@]}" adasplash entmax || echo "[gpu_check] optional peers not installed (their rows are skipped)"
else
  echo "[gpu_check] install failed (offline?): running from the working tree, PYTHONPATH=src"
  export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
TORCH_AFTER=$(python -c "import torch; print(torch.__version__)")
if [[ "$TORCH_BEFORE" != "$TORCH_AFTER" ]]; then
  echo "[gpu_check] error: the install replaced torch $TORCH_BEFORE by $TORCH_AFTER" >&2
  exit 1
fi
python -c "import attnopt, torch, triton, pytest, hypothesis; print('[gpu_check] triton', triton.__version__, '| torch', torch.__version__, '|', attnopt.__file__)"

elapsed "pytest -m gpu"
set +e
timeout 120 python -m pytest -q -m gpu -p no:randomly tests/functional/triton 2>&1 | tee "$OUT/pytest.log"
TESTS=${PIPESTATUS[0]}
set -e

elapsed "bench"
timeout 200 python -m attnopt bench --device cuda --only cuda --repeat 3 --out "$OUT/bench.md" || BENCH=$?
elapsed "done: pytest exit $TESTS, bench exit ${BENCH:-0}; results in $OUT/"
exit $(( TESTS != 0 || ${BENCH:-0} != 0 ))
