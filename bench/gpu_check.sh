#!/usr/bin/env bash
# The GPU checklist in one command, from the repository root:
#
#   bench/gpu_check.sh [--dry-run] [OUT_DIR]      (OUT_DIR default: $OUT, else bench/results/gpu_check)
#
# Parts, in order, each in its own process under its own time limit, each writing under OUT_DIR as
# soon as it finishes (a part that runs out of memory or time loses nothing the others wrote):
#   tests     the cuda-marked tests                       tests/pytest.log, tests/junit.xml
#   probe     graph pools vs the cost model, fused kernels
#             vs torch, dropout masks GPU vs CPU           probe/probe.json
#   bench     mhc-cg bench, every mode (attn_split too)    bench/<device-slug>.{json,md}
#   profiles  a torch.profiler trace per training mode     profiles/<mode>.json.gz
#   timeline  mhc-cg timeline compare, graphed_static
#             against every other mode                     timeline/graphed_static_vs_<mode>.{txt,json}
# summary.tsv gets one line per part (status, exit code, seconds, limit) as it ends; env.txt says
# what ran. The limits add up to GPU_CHECK_BUDGET_S (default 1140 s, under 20 minutes); a part
# that would start with less than 15 s left is skipped and says so.
#
# GPU_CHECK_PARTS (space-separated, default all: tests probe bench profile timeline) runs a subset,
# so the checklist can be split over calls of a machine that limits one command's time; the
# summary is then appended to, not rewritten.
#
# --dry-run (or MHC_CG_GPU_CHECK_DRY=1): the same parts on the CPU with a tiny config and the tape
# backend, a few steps each, three modes (eager_none, graphed_static, attn_split); CI runs it
# (tests/test_gpu_check.py). GPU_CHECK_MODES, GPU_CHECK_TESTS and GPU_CHECK_CONFIG override the
# modes, the test paths and the config.
set -u -o pipefail

DRY=${MHC_CG_GPU_CHECK_DRY:-0}
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT_DIR=${1:-${OUT:-bench/results/gpu_check}}
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/summary.tsv"
PARTS=${GPU_CHECK_PARTS:-tests probe bench profile timeline}
[ -s "$SUMMARY" ] && [ -n "${GPU_CHECK_PARTS:-}" ] || printf 'part\tstatus\texit_code\tseconds\tlimit_s\n' > "$SUMMARY"
START=$(date +%s)

# BUDGET: seconds for all parts; LIMITS: each part's own limit (a profile's applies per mode)
if [ "$DRY" = "1" ]; then
    CFG="$OUT_DIR/dry_config.yaml"
    cat > "$CFG" <<'EOF'
model: {vocab_size: 32, seq_length: 8, hidden_size: 16, num_heads: 2, num_layers: 2,
        num_streams: 4, hidden_dropout: 0.1, dropout_impl: counter, recompute: block,
        recompute_layers: 2}
train: {micro_batch_size: 2, seed: 7, device: cpu}
graph: {backend: tape, cuda_graph_scope: [attn, mlp, mhc_recompute]}
EOF
    DEVICE=(--device cpu)
    TESTS=${GPU_CHECK_TESTS:-tests/test_graphs_cuda.py}
    BENCH_ARGS=(--backend tape --steps 2 --warmup 1 --chunk 1 --recompute-replays 2 --moe-experts 4)
    PROBE_ARGS=(--backend tape)
    PROFILE_STEPS=2
    # the reference, ours and the peer: every code path of the script, at a third of the cost
    MODES=${GPU_CHECK_MODES:-eager_none graphed_static attn_split}
    BENCH_ARGS+=(--modes "${MODES// /,}")
    # generous: CI machines are small and shared
    BUDGET=${GPU_CHECK_BUDGET_S:-1800}
    LIMITS=(tests=180 probe=300 bench=300 profile=240 timeline=240)
else
    CFG=${GPU_CHECK_CONFIG:-configs/bench_h100.yaml}
    DEVICE=(--device cuda)
    # the modules with cuda-marked tests: collecting the rest would import what the GPU machine lacks
    TESTS=${GPU_CHECK_TESTS:-$(grep -l 'pytest.mark.cuda' tests/test_*.py | tr '\n' ' ')}
    BENCH_ARGS=()
    PROBE_ARGS=()
    PROFILE_STEPS=5
    MODES=${GPU_CHECK_MODES:-eager_none eager_block graphed_none graphed_static attn_split}
    BUDGET=${GPU_CHECK_BUDGET_S:-1140}
    LIMITS=(tests=180 probe=150 bench=420 profile=60 timeline=90)
fi
limit_of() { local kv; for kv in "${LIMITS[@]}"; do [ "${kv%%=*}" = "$1" ] && echo "${kv#*=}"; done; }

{
    echo "# bench/gpu_check.sh $([ "$DRY" = 1 ] && echo --dry-run) $OUT_DIR"
    echo "started $(date -u +%Y-%m-%dT%H:%M:%SZ); config $CFG; budget ${BUDGET} s; parts $PARTS"
    echo "git $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git status --porcelain --untracked-files=no 2>/dev/null | grep -q . && echo ' (uncommitted changes)')"
    "$PY" - <<'EOF' 2>&1
import importlib.util, platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, cuda {torch.version.cuda}")
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for name in ("triton", "yaml", "nvtx", "megatron.core", "transformer_engine"):
    try:
        found = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        found = False
    print(f"{name}: {'yes' if found else 'no'}")
EOF
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
} >> "$OUT_DIR/env.txt" 2>&1

# part NAME LIMIT_S LOG CMD...: run CMD under min(LIMIT_S, what is left), log to LOG, one summary line
part() {
    local name=$1 limit=$2 log=$3; shift 3
    case " $PARTS " in *" ${name%%:*} "*) ;; *) return 0 ;; esac
    local left=$(( BUDGET - ($(date +%s) - START) ))
    mkdir -p "$(dirname "$log")"
    if [ "$left" -lt 15 ]; then
        printf '%s\tskipped (budget spent)\t-\t0\t%s\n' "$name" "$limit" >> "$SUMMARY"
        echo "[gpu_check] $name: skipped, ${left} s of the budget left" >&2
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "[gpu_check] $name: limit ${limit} s -> $log" >&2
    local begin=$(date +%s) rc status
    timeout --kill-after=15 "$limit" "$@" > "$log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124|137) status="timed out" ;;
        *) status=failed ;;
    esac
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$(( $(date +%s) - begin ))" "$limit" >> "$SUMMARY"
    echo "[gpu_check] $name: $status (exit $rc)" >&2
}

part tests "$(limit_of tests)" "$OUT_DIR/tests/pytest.log" \
    "$PY" -m pytest -m cuda -q -rs -p no:cacheprovider --junitxml="$OUT_DIR/tests/junit.xml" $TESTS

part probe "$(limit_of probe)" "$OUT_DIR/probe/probe.log" \
    "$PY" -m mhc_cg.tools.probe --config "$CFG" --out "$OUT_DIR/probe" "${DEVICE[@]}" "${PROBE_ARGS[@]}"

part bench "$(limit_of bench)" "$OUT_DIR/bench/bench.log" \
    "$PY" -m mhc_cg.cli bench --config "$CFG" --out-dir "$OUT_DIR/bench" "${DEVICE[@]}" "${BENCH_ARGS[@]}"

for mode in $MODES; do
    part "profile:$mode" "$(limit_of profile)" "$OUT_DIR/profiles/$mode.log" \
        "$PY" profiles/profile_torch.py --out "$OUT_DIR/profiles/$mode.json.gz" -- \
        --config "$CFG" --mode "$mode" --steps "$PROFILE_STEPS" --no-progress "${DEVICE[@]}"
done

part timeline "$(limit_of timeline)" "$OUT_DIR/timeline/timeline.log" \
    "$PY" profiles/compare_modes.py --traces "$OUT_DIR/profiles" --base graphed_static \
    --out "$OUT_DIR/timeline"

echo "[gpu_check] done in $(( $(date +%s) - START )) s; summary:" >&2
column -t -s $'\t' "$SUMMARY" >&2 2>/dev/null || cat "$SUMMARY" >&2
# exit 1 when any part did not end ok, so a caller sees it without reading the summary
! tail -n +2 "$SUMMARY" | cut -f2 | grep -qv '^ok$'
