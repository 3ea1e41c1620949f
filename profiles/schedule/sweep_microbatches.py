"""How the static buffers of pp 4, vpp 2, 32 layers scale with the number of microbatches M.

Run: .venv/bin/python profiles/schedule/sweep_microbatches.py
Per-rank figures are printed as rank0/rank1/rank2/rank3; bytes are rank 0's (the largest), for the
default shape of `mhc-cg schedule` (hidden 4096, seq 4096, mbs 1, n = 4, bf16).
"""

from mhc_cg.lab.planning.planner import plan


def per_rank(plans, name):
    return "/".join(str(getattr(p, name)) for p in plans)


def main() -> None:
    header = ("M", "graphs", "static inputs (reuse)", "static inputs (no reuse)", "slot sets",
              "recompute graphs", "rank0 inputs GiB reuse / no reuse", "rank0 persistent GiB")
    rows = []
    for m in (8, 16, 32, 64, 128, 256):
        plans = plan(4, 2, m, 32)
        r0 = plans[0]
        rows.append((str(m), per_rank(plans, "num_graphs"), per_rank(plans, "static_input_buffers"),
                     per_rank(plans, "static_input_buffers_no_reuse"),
                     per_rank(plans, "persistent_slot_sets"), per_rank(plans, "recompute_graphs"),
                     f"{r0.static_input_bytes / 2**30:.1f} / {r0.static_input_bytes_no_reuse / 2**30:.1f}",
                     f"{r0.persistent_bytes / 2**30:.1f}"))
        assert all(p.conflict is None for p in plans)
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |")
    print(f"arena per rank: {plans[0].arena_bytes / 2**30:.2f} GiB (constant in M); "
          f"recompute block {plans[0].recompute_block_size} layers")


if __name__ == "__main__":
    main()
