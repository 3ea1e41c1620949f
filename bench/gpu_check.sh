#!/usr/bin/env bash
# The GPU checklist in one run of at most 9 minutes, from the repository root:
#
#   bench/gpu_check.sh [--dry-run] [OUT_DIR]      (OUT_DIR default: $OUT, else bench/results/gpu_check)
#
# Parts, most valuable first, each in its own process under its own time limit:
#   peers     mhc-cg kernels --peers: each mHC op family through ours, TransformerEngine's Triton
#             kernels, Megatron-LM dev's fused kernels and main's torch module, same inputs, one
#             process: device time, GB/s, each peer over ours
#   bench     mhc-cg bench: every mode, each in a process of its own, at the bench shape and the
#             memory shape
#   te        mhc-cg bench: graphed_static at the bench shape, its graphs captured by
#             TransformerEngine's own make_graphed_callables (its wheel's graph.py)
#   kernels   mhc-cg kernels --bench --sweep: each fused op's device time apart from its launch
#             cost, GB/s against the cost model's bytes; the launch-configuration sweep
#   layer     mhc-cg megatron --layer-time: one step of Megatron-LM dev's mHC layer at the bench
#             shape, native (torch.compile on, as a user runs it), on mhc_cg's fused kernels and
#             with dev's own fused module, one process; and --layer-cost, its kernels and bytes
#             (its files go into megatron.tar.gz: a device call brings back 8 files)
#   megatron  Megatron-LM main's mHC GPT under main's own TECudaGraphHelper (calling TE's own
#             make_graphed_callables from its wheel) against main eager
#   tests     the cuda-marked tests
# What comes back: a device call returns at most 8 files from its output folder, two folders down
# at most, 16 MiB each. So OUT_DIR holds at most 8: env.txt (what ran), summary.tsv (a line per part:
# status, exit code, seconds, limit) and one archive per part, <part>.tar.gz, written as the part
# ends whatever its status (a run cut short keeps every part that finished). Each part works in a
# scratch folder (GPU_CHECK_WORK, default a new folder under $TMPDIR); an archive over 16 MiB is
# remade without its largest files, which <part>/LEFT_OUT.txt then names.
#   python -m mhc_cg.lab.benchmarks.gpu_run unpack OUT_DIR     the parts' files, under bench/results/
#   python -m mhc_cg.lab.benchmarks.gpu_run fold OUT_DIR       that, the measurements merged, the back-test
# The limits add up to GPU_CHECK_BUDGET_S (default 540 s); a part that would start with less than
# 15 s left is skipped and says so. GPU_CHECK_PARTS (space-separated) runs a subset.
#
# What the machine needs beyond torch and Triton: the wheels, the TransformerEngine wheel (loaded by
# path, never installed) and the Megatron-LM snapshots of bench/carry/ (bench/fetch_carry.sh makes
# it; bench/README.md says how to run this there).
#
# --dry-run (or MHC_CG_GPU_CHECK_DRY=1): the same parts on the CPU with tiny configs and the tape
# backend, a few steps each, three modes; CI runs it (tests/test_gpu_check.py).
set -u -o pipefail

DRY=${MHC_CG_GPU_CHECK_DRY:-0}
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT_DIR=${1:-${OUT:-bench/results/gpu_check}}
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
MAX_ARCHIVE_BYTES=${GPU_CHECK_MAX_ARCHIVE_BYTES:-$((16 * 1024 * 1024))}
if [ -n "${GPU_CHECK_WORK:-}" ]; then
    WORK=$GPU_CHECK_WORK
    mkdir -p "$WORK"
else
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
    trap 'rm -rf "$WORK"' EXIT
fi
SUMMARY="$OUT_DIR/summary.tsv"
PARTS=${GPU_CHECK_PARTS:-peers bench te kernels layer megatron tests}
[ -s "$SUMMARY" ] && [ -n "${GPU_CHECK_PARTS:-}" ] || printf 'part\tstatus\texit_code\tseconds\tlimit_s\n' > "$SUMMARY"
START=$(date +%s)
# the Megatron-LM snapshot brought along (bench/carry), where the harness looks for it
if [ -z "${MHC_CG_THIRD_PARTY:-}" ] && ls bench/carry/megatron-lm-main-*.tar.gz >/dev/null 2>&1; then
    export MHC_CG_THIRD_PARTY="$PWD/bench/carry"
fi
# the TE wheel the peers part loads by path (mhc_cg/lab/benchmarks/kernel_peers.py looks there too)
if [ -z "${MHC_CG_TE_WHEEL:-}" ] && ls bench/carry/peers/transformer_engine-*.whl >/dev/null 2>&1; then
    export MHC_CG_TE_WHEEL="$PWD/bench/carry/peers"
fi

if [ "$DRY" = "1" ]; then
    SHAPE="$WORK/dry_shape.yaml"
    MEMORY="$WORK/dry_memory.yaml"
    cat > "$SHAPE" <<'EOF'
model: {vocab_size: 32, seq_length: 8, hidden_size: 16, num_heads: 2, num_layers: 2,
        num_streams: 4, hidden_dropout: 0.1, dropout_impl: counter, recompute: block,
        recompute_layers: 2}
train: {micro_batch_size: 2, seed: 7, device: cpu}
graph: {backend: tape, cuda_graph_scope: [attn, mlp, mhc_recompute]}
EOF
    sed 's/seq_length: 8,/seq_length: 32,/' "$SHAPE" > "$MEMORY"
    TE_SHAPE="$WORK/dry_te.yaml"
    sed 's/backend: tape,/backend: te,/' "$SHAPE" > "$TE_SHAPE"
    DEVICE=(--device cpu)
    TESTS=${GPU_CHECK_TESTS:-tests/test_graphs_cuda.py}
    # the reference, sublayer graphs and one captured iteration: every code path of the script,
    # at a fraction of the cost
    MODES=${GPU_CHECK_MODES:-eager_none graphed_static graphed_full_static}
    BENCH_ARGS=(--config "$SHAPE" --config "$MEMORY" --backend tape --steps 2 --warmup 1
                --profile-steps 1 --recompute-replays 2)
    TE_BENCH_ARGS=(--config "$TE_SHAPE" --steps 2 --warmup 1 --profile-steps 1
                   --recompute-replays 2)
    KERNEL_ARGS=(--dry-run)
    export LAYER_SHAPE="" LAYER_STEPS=1  # the config's own tiny shape
    BUDGET=${GPU_CHECK_BUDGET_S:-900}  # generous: CI machines are small and shared
    LIMITS=(peers=200 bench=400 te=120 kernels=200 layer=120 megatron=300 tests=120)
else
    DEVICE=(--device cuda)
    # the modules with cuda-marked tests: collecting the rest would import what the GPU machine lacks
    TESTS=${GPU_CHECK_TESTS:-$(grep -l 'pytest.mark.cuda' tests/test_*.py | tr '\n' ' ')}
    MODES=${GPU_CHECK_MODES:-eager_none eager_block graphed_none graphed_static attn_split graphed_full graphed_full_static plain_residual}
    BENCH_ARGS=(--config configs/bench_h100.yaml --config configs/bench_h100_memory.yaml
                --mode-timeout 90)
    TE_BENCH_ARGS=(--config configs/bench_h100_te.yaml --mode-timeout 40)
    KERNEL_ARGS=()
    export LAYER_SHAPE=configs/bench_h100.yaml LAYER_STEPS=10
    BUDGET=${GPU_CHECK_BUDGET_S:-540}
    LIMITS=(peers=105 bench=205 te=40 kernels=50 layer=40 megatron=65 tests=35)
fi
limit_of() { local kv; for kv in "${LIMITS[@]}"; do [ "${kv%%=*}" = "$1" ] && echo "${kv#*=}"; done; }

{
    echo "# bench/gpu_check.sh $([ "$DRY" = 1 ] && echo --dry-run) $OUT_DIR"
    echo "started $(date -u +%Y-%m-%dT%H:%M:%SZ); budget ${BUDGET} s; parts $PARTS; modes $MODES"
    echo "git $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git status --porcelain --untracked-files=no 2>/dev/null | grep -q . && echo ' (uncommitted changes)')"
    "$PY" - <<'EOF' 2>&1
import importlib.util, platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, cuda {torch.version.cuda}")
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for name in ("triton", "yaml", "nvtx", "megatron.core", "transformer_engine", "pytest"):
    try:
        found = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        found = False
    print(f"{name}: {'yes' if found else 'no'}")
EOF
    echo "megatron-lm snapshots: ${MHC_CG_THIRD_PARTY:-../shared/third_party (default)}"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
} >> "$OUT_DIR/env.txt" 2>&1

# the archive a part's files go into: its own, but the layer part's join megatron's
archive_of() { [ "$1" = layer ] && echo megatron || echo "$1"; }

# pack NAME: the part's scratch folder as OUT_DIR/NAME.tar.gz; over MAX_ARCHIVE_BYTES, made again
# without its largest file, one at a time until it fits, each named in NAME/LEFT_OUT.txt
pack() {
    local name=$1 archive="$OUT_DIR/$1.tar.gz" notes="$WORK/$1/LEFT_OUT.txt" file
    mkdir -p "$WORK/$name"
    tar -czf "$archive" -C "$WORK" "$name"
    while [ "$(stat -c %s "$archive")" -gt "$MAX_ARCHIVE_BYTES" ]; do
        file=$(find "$WORK/$name" -type f ! -name LEFT_OUT.txt -printf '%s %p\n' | sort -rn \
               | head -n 1 | cut -d' ' -f2-)
        [ -n "$file" ] || break
        [ -f "$notes" ] || echo "left out of $name.tar.gz to keep it within $MAX_ARCHIVE_BYTES bytes (bytes, file):" > "$notes"
        echo "$(stat -c %s "$file") ${file#"$WORK"/}" >> "$notes"
        rm -f "$file"  # the scratch copy: the archive is what comes back
        tar -czf "$archive" -C "$WORK" "$name"
    done
}

# part NAME LIMIT_S LOG CMD...: run CMD under min(LIMIT_S, what is left), log to LOG, one summary
# line, then the part's archive
part() {
    local name=$1 limit=$2 log=$3; shift 3
    case " $PARTS " in *" $name "*) ;; *) return 0 ;; esac
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
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124|137) status="timed out" ;;
        *) status=failed ;;
    esac
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$(( $(date +%s) - begin ))" "$limit" >> "$SUMMARY"
    pack "$(archive_of "$name")"
    echo "[gpu_check] $name: $status (exit $rc) -> $OUT_DIR/$(archive_of "$name").tar.gz" >&2
}

# its stdout, the report as JSON, is the log (peers.json beside it is the same report)
part peers "$(limit_of peers)" "$WORK/peers/peers.log" \
    "$PY" -m mhc_cg.cli kernels --peers --json --no-progress --out "$WORK/peers" \
    "${KERNEL_ARGS[@]}"

part bench "$(limit_of bench)" "$WORK/bench/bench.log" \
    "$PY" -m mhc_cg.cli bench "${BENCH_ARGS[@]}" --modes "${MODES// /,}" --out-dir "$WORK/bench" \
    "${DEVICE[@]}"

part te "$(limit_of te)" "$WORK/te/bench.log" \
    "$PY" -m mhc_cg.cli bench "${TE_BENCH_ARGS[@]}" --modes graphed_static --out-dir "$WORK/te" \
    "${DEVICE[@]}"

part kernels "$(limit_of kernels)" "$WORK/kernels/kernels.log" \
    "$PY" -m mhc_cg.cli kernels --bench --sweep --no-progress --out "$WORK/kernels" \
    "${KERNEL_ARGS[@]}"

# dev's layer: its step timed three ways (layer_time.json), its kernels and bytes (layer_cost.json)
part layer "$(limit_of layer)" "$WORK/megatron/layer.log" \
    bash -c 'for what in time cost; do
                 "$0" -m mhc_cg.cli megatron --config configs/megatron_dev_fused.yaml \
                     --layer-$what --json ${LAYER_SHAPE:+--shape "$LAYER_SHAPE"} \
                     $([ $what = time ] && echo --steps "$LAYER_STEPS") \
                     > "$1/layer_$what.json" || exit 1
             done' "$PY" "$WORK/megatron"

# the harness runs on the device it finds (train.device: auto); --json is the record
part megatron "$(limit_of megatron)" "$WORK/megatron/megatron.log" \
    bash -c '"$0" -m mhc_cg.cli megatron --config configs/megatron_main_mhc.yaml --compare --json \
             --no-progress > "$1"' "$PY" "$WORK/megatron/compare.json"

part tests "$(limit_of tests)" "$WORK/tests/pytest.log" \
    "$PY" -m pytest -m cuda -q -rs -p no:cacheprovider --junitxml="$WORK/tests/junit.xml" $TESTS

echo "[gpu_check] done in $(( $(date +%s) - START )) s; summary:" >&2
column -t -s $'\t' "$SUMMARY" >&2 2>/dev/null || cat "$SUMMARY" >&2
# exit 1 when any part did not end ok, so a caller sees it without reading the summary
! tail -n +2 "$SUMMARY" | cut -f2 | grep -qv '^ok$'
