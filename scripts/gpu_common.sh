# Sourced by the scripts/gpu_*.sh runs on the GPU machine: install the carried wheels
# (.whl/, from ../shared/gpu/wheels.sh), set PYTHONPATH and the model cache, compile
# Triton for real, and record the versions in $OUT/versions.txt (OUT must be set).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export SCHEDKIT_CACHE_DIR=/tmp/schedkit-cache
unset TRITON_INTERPRET
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} > "$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"
