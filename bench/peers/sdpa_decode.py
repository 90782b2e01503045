"""PyTorch SDPA's decode step, the peer of vkbench's dense attention.

One query token per sequence (Hq heads) attends N cached keys and values
(Hkv heads, grouped-query attention), fp16, under a CUDA graph; the median of
repeated replays, timed by CUDA events, is printed and written as JSON.
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F


def time_step(n, batch, hq, hkv, dim, reps):
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(batch, hq, 1, dim, device="cuda", dtype=torch.float16, generator=g)
    k = torch.randn(batch, hkv, n, dim, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn(batch, hkv, n, dim, device="cuda", dtype=torch.float16, generator=g)
    out = torch.empty_like(q)

    def step():
        out.copy_(F.scaled_dot_product_attention(q, k, v, enable_gqa=True))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(10):
        graph.replay()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    med = statistics.median(times)
    read = 2 * batch * hkv * n * dim * 2
    return {"n": n, "batch": batch, "median_us": med, "gbps": read / med / 1e3}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", default="32768,131072")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    rows = []
    for n in map(int, a.n.split(",")):
        for b in map(int, a.batch.split(",")):
            r = time_step(n, b, a.heads, a.kv_heads, a.dim, a.reps)
            rows.append(r)
            print("N %7d  B %d  SDPA %9.1f us  %7.1f GB/s" % (n, b, r["median_us"], r["gbps"]))
    if a.json:
        doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
