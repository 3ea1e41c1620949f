#!/usr/bin/env bash
# Profile `mhc-cg train` under Nsight Systems and export the report to SQLite for `mhc-cg timeline`.
#
#   profiles/profile_nsys.sh OUT_BASE -- [mhc-cg train flags]
#   e.g. profiles/profile_nsys.sh profiles/gpu/eager_block -- --config configs/tiny_cpu.yaml --steps 20
#
# Writes OUT_BASE.nsys-rep (nsys profile --trace=cuda,nvtx), OUT_BASE.sqlite (nsys export --type
# sqlite) and OUT_BASE.command.txt (the exact commands, nsys/python/torch versions, GPU, git revision).
# Where nsys is not on PATH it says so and profiles with torch.profiler instead
# (profiles/profile_torch.py -> OUT_BASE.json.gz, a Chrome trace that `mhc-cg timeline` also reads).
# PYTHON selects the interpreter (default: python3); NSYS the nsys binary (default: nsys).
set -euo pipefail

usage() { echo "usage: $0 OUT_BASE -- [mhc-cg train flags]" >&2; exit 2; }
[[ $# -ge 1 && $1 != -* ]] || usage
out=$1; shift
if [[ $# -gt 0 ]]; then [[ $1 == -- ]] || usage; shift; fi

python=${PYTHON:-python3}
nsys=${NSYS:-nsys}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$(dirname "$out")"

if ! command -v "$nsys" >/dev/null 2>&1; then
    echo "profile_nsys: '$nsys' not found on PATH; profiling under torch.profiler instead" >&2
    exec "$python" "$here/profile_torch.py" --out "$out.json.gz" -- "$@"
fi

export MHC_CG_NVTX=1  # the NVTX ranges are what the comparison aggregates by
profile_cmd=("$nsys" profile --trace=cuda,nvtx --force-overwrite=true --output "$out"
             "$python" -m mhc_cg.cli train "$@")
export_cmd=("$nsys" export --type sqlite --force-overwrite=true --output "$out.sqlite" "$out.nsys-rep")
"${profile_cmd[@]}"
"${export_cmd[@]}"

{
    echo "# regenerate (from the directory it was run in):"
    printf '%q ' "$0" "$out" -- "$@"; echo
    echo "# which ran:"
    printf '%q ' "${profile_cmd[@]}"; echo
    printf '%q ' "${export_cmd[@]}"; echo
    echo "# recorded $(date -Iseconds) on $(hostname)"
    echo "nsys: $("$nsys" --version 2>&1 | head -n 1)"
    "$python" - <<'EOF'
import platform
from importlib.metadata import PackageNotFoundError, version

import torch

def v(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"

gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none visible to torch"
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"nvtx {v('nvtx')}, mhc_cg {v('mhc_cg')}; GPU {gpu}")
EOF
    echo "git: $(git -C "$here/.." rev-parse --short HEAD 2>/dev/null || echo unknown)" \
         "$(git -C "$here/.." status --porcelain --untracked-files=no 2>/dev/null | grep -q . && echo '(uncommitted changes)')"
    if command -v nvidia-smi >/dev/null 2>&1; then
        echo "driver: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1)"
    fi
} > "$out.command.txt"
echo "wrote $out.nsys-rep, $out.sqlite and $out.command.txt"
