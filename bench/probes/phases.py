#!/usr/bin/env python3
"""Summarises the stamps that attention-phases.patch makes `vkbench tactic`
write (VKSPARSE_STAMPS=PREFIX gives PREFIX-<layer>.json): per kind of
workgroup (runs of clusters, chunks of fixed tokens, the blocks' mergers),
the mean, median and largest time of each phase, and when the workgroups
end; then each head block's chunks and merge.

Record: [workgroup, device clock at start (lo, hi), at end (lo, hi), SM
cycles of thread 0 in the 12 phases below, rows attended, tiles, flags
(bit 31: merged its block, bits 16-30: block, bits 0-15: workgroup within
it), unused]."""
import collections
import json
import statistics as st
import sys

PHASES = ["queries, first window", "later windows", "tile lists", "key pass", "weights", "value pass",
          "lane sums, partial", "arrival", "merge: exchange, output", "sum of l", "merge: fence", "merge: loads, fold"]
ORDER = [0, 1, 2, 3, 4, 5, 9, 6, 7, 10, 11, 8]


def clock(lo, hi):
    return lo | hi << 32


for path in sys.argv[1:]:
    w = json.load(open(path))["workgroups"]
    start = [clock(r[1], r[2]) for r in w]
    end = [clock(r[3], r[4]) for r in w]
    t0 = min(start)
    # SM cycles per ns of the device's clock: the phases' cycles over each workgroup's span.
    ghz = st.median(sum(r[5:17]) / max(1, e - s) for r, s, e in zip(w, start, end))
    print(f"== {path}: {len(w)} workgroups, SM clock {ghz:.2f} GHz")
    print(f"starts within {(max(start) - t0) / 1e3:.2f} µs; ends: first {(min(end) - t0) / 1e3:.2f}, "
          f"median {(st.median(end) - t0) / 1e3:.2f}, last {(max(end) - t0) / 1e3:.2f} µs")
    merger = lambda r: r[19] >> 31
    kinds = {"runs": [r for r in w if r[17] > 0 and not merger(r)],
             "fixed chunks": [r for r in w if r[17] == 0 and r[18] > 0 and not merger(r)],
             "mergers": [r for r in w if merger(r)]}
    for kind, rs in kinds.items():
        if not rs:
            continue
        print(f"  {kind}: {len(rs)}, rows median {st.median(r[17] for r in rs)}, most {max(r[17] for r in rs)}")
        for i in ORDER:
            v = [r[5 + i] / ghz / 1e3 for r in rs]
            print(f"    {PHASES[i]:24s} mean {st.mean(v):6.2f}  median {st.median(v):6.2f}  most {max(v):6.2f} µs")
    chunks = collections.Counter(r[19] >> 16 & 0x7FFF for r in w)
    for r in kinds["mergers"]:
        b = r[19] >> 16 & 0x7FFF
        merge = (r[5 + 8] + r[5 + 10] + r[5 + 11]) / ghz / 1e3
        print(f"  block {b}: {chunks[b]} chunks, merge {merge:.2f} µs, ends {(clock(r[3], r[4]) - t0) / 1e3:.2f} µs")
