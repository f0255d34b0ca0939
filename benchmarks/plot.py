"""Benchmark JSON -> PNG charts (busbw and latency against size, per op, myccl vs baseline).

    python benchmarks/plot.py bench_out/collbench_cpu_ws2.json [more.json ...]
    python benchmarks/plot.py bench_out/ddp_bench.json
    python benchmarks/plot.py --markdown bench_out/collbench_cpu_ws2.json   # the README's table
"""

from __future__ import annotations

import json
import sys


def plot_collbench(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    ops = [o for o in dict.fromkeys(r["op"] for r in result["raw"]) if o != "barrier"]
    fig, axes = plt.subplots(2, len(ops), figsize=(3.2 * len(ops), 6), squeeze=False)
    for j, op in enumerate(ops):
        labels = list(dict.fromkeys(r["backend"] for r in result["raw"]))
        styles = {b: ("--s" if b == result["baseline"] else ("-o" if b == "myccl" else "-.^")) for b in labels}
        for backend, style in styles.items():
            pts = sorted((r["bytes"], r["busbw_gbs"], r["time_us"]) for r in result["raw"]
                         if r["op"] == op and r["backend"] == backend)
            if not pts:
                continue
            x = [p[0] for p in pts]
            axes[0][j].plot(x, [p[1] for p in pts], style, ms=3, label=backend)
            axes[1][j].plot(x, [p[2] for p in pts], style, ms=3, label=backend)
        axes[0][j].set_title(op, fontsize=9)
        for i in range(2):
            axes[i][j].set_xscale("log", base=2)
            axes[i][j].tick_params(labelsize=7)
        axes[1][j].set_yscale("log")
        axes[1][j].set_xlabel("bytes", fontsize=8)
    axes[0][0].set_ylabel("busbw (GB/s)")
    axes[1][0].set_ylabel("time per op (us)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"collbench: world size {result['world_size']}, {result['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def markdown_collbench(result: dict, small: int = 8, mids=(2 << 20,), large=(32 << 20, 256 << 20)) -> str:
    """One row per op: latency at `small` bytes and busbw at the larger sizes, myccl vs the
    baseline, with the speed-up. Sizes absent from the run are left out."""
    by = {(r["op"], r["bytes"]): r for r in result["rows"]}
    sizes = [s for s in (*mids, *large) if any(k[1] == s for k in by)]

    def fmt(n):
        return f"{n >> 20} MiB" if n >= 1 << 20 else (f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} B")

    base = result["baseline"]
    head = f"| op | {fmt(small)} (or the smallest size): myccl / {base} (µs) | " + " | ".join(
        f"{fmt(s)}: myccl / {base} busbw (GB/s)" for s in sizes) + " |"
    lines = [head, "|" + "---|" * (2 + len(sizes))]
    for op in dict.fromkeys(r["op"] for r in result["rows"]):
        if op == "barrier":
            r = by.get((op, 0))
            lines.append(f"| barrier | {r['time_us']:.0f} / {r['baseline_time_us']:.0f} ({r['speedup']:.0f}x) |"
                         + " |" * len(sizes))
            continue
        r = by.get((op, small)) or min((v for k, v in by.items() if k[0] == op), key=lambda v: v["bytes"], default=None)
        cells = [f"{r['time_us']:.0f} / {r['baseline_time_us']:.0f} ({r['speedup']:.0f}x)" if r else "-"]
        for s in sizes:
            r = by.get((op, s))
            cells.append(f"{r['busbw_gbs']:.2f} / {r['baseline_busbw_gbs']:.2f} ({r['speedup']:.1f}x)" if r else "-")
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_generic_rows(result: dict, path: str) -> None:
    """Bar chart for benchmarks that report named rows with a time (e.g. ddp_bench)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    rows = result.get("rows", [])
    labels = [r.get("name") or r.get("label") or str(i) for i, r in enumerate(rows)]
    key = next((k for k in ("step_ms", "time_ms", "time_us") if rows and k in rows[0]), None)
    if key is None:
        print(f"{path}: nothing to plot")
        return
    fig, ax = plt.subplots(figsize=(1.2 + 1.3 * len(rows), 3.2))
    ax.bar(labels, [r[key] for r in rows])
    ax.set_ylabel(key)
    ax.tick_params(axis="x", labelsize=7, rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    markdown = argv[0] == "--markdown"
    for p in argv[1:] if markdown else argv:
        with open(p) as f:
            result = json.load(f)
        if markdown:
            print(f"world size {result['world_size']}, {result['device']}"
                  + (f", one-core copy {result['copy_gbs']:.1f} GB/s" if result.get("copy_gbs") else "") + ":\n")
            print(markdown_collbench(result) + "\n")
            continue
        out = p[:-5] + ".png" if p.endswith(".json") else p + ".png"
        if "raw" in result and "baseline" in result:
            plot_collbench(result, out)
        else:
            plot_generic_rows(result, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
