# Sourced by every run script: puts a Python with the project's requirements on PATH.
# - default: a repo-local virtualenv .venv, created (or refreshed when requirements.txt changes) on first use;
# - SFL_USE_SYSTEM_PYTHON=1: use python3 as found (the GPU machine, whose image brings torch + CUDA).
# CPU torch is installed first and pinned so nothing pulls the multi-GB CUDA build.
set -euo pipefail
SFL_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export SFL_ROOT
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$SFL_ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ "${SFL_USE_SYSTEM_PYTHON:-0}" != "1" ]; then
  venv="$SFL_ROOT/.venv"
  stamp="$venv/.requirements.sha256"
  want="$(sha256sum "$SFL_ROOT/requirements.txt" | cut -d' ' -f1)"
  if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "[env] creating $venv from requirements.txt (first run: ~2 min)" >&2
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
    if ! "$venv/bin/python" -m pip install -q "$(grep -E '^torch==' "$SFL_ROOT/requirements.txt")" \
       || ! "$venv/bin/python" -m pip install -q -r "$SFL_ROOT/requirements.txt"; then
      echo "[env] pip install failed; retry with: python3 -m pip install -r requirements.txt inside $venv" >&2
      exit 1
    fi
    echo "$want" > "$stamp"
  fi
  # shellcheck disable=SC1091
  . "$venv/bin/activate"
fi
