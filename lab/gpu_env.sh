# Sourced at the start of a device call: the GPU machine's own python, this checkout on PYTHONPATH, NVLink multicast
# off, the kernels' build cache inside the checkout (kept while the machine stays warm), a log helper.
export SFL_USE_SYSTEM_PYTHON=1 PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 MAX_JOBS=16 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 SFL_KERNEL_BUILD_DIR="$PWD/.torch_extensions"
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
build() { python3 -c "from sfl.kernels.twell.ops import load; load(); from sfl.kernels.train.ops import load_ext; load_ext()" \
  > "$OUT/build.txt" 2>&1; say "build rc=$?"; }
