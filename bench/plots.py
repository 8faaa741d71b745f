"""PNG plots of `pdserve bench` results, when matplotlib is importable (it is not a
dependency): latency percentiles vs load (where the knee shows), throughput and goodput vs
load, the TTFT CDF of every run, and (from a server that sends it: pdserve) the TTFT broken
into its parts. Several endpoints are overlaid, one colour each."""
from __future__ import annotations

import sys
from pathlib import Path

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def write_plots(plot_dir: Path, results: dict, ttft_samples: dict) -> list[Path]:
    """Write latency.png, throughput.png, ttft_cdf.png (and ttft_breakdown.png when some run
    has a breakdown) under `plot_dir`; returns the paths
    written (none, after one notice, without matplotlib). `ttft_samples` maps
    (endpoint, load label) to that run's sorted TTFTs in seconds."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return []
    plot_dir.mkdir(parents=True, exist_ok=True)
    endpoints = results["endpoints"]
    # every endpoint ran the same load points: one categorical x axis for all of them
    labels = [r["label"] for r in next(iter(endpoints.values()))["runs"]]
    xs = range(len(labels))
    written = []

    fig, axes = plt.subplots(1, len(LATENCIES), figsize=(4.2 * len(LATENCIES), 3.8))
    for ax, (key, title) in zip(axes, LATENCIES):
        for k, (name, ep) in enumerate(endpoints.items()):
            color = f"C{k}"
            for q, style in (("p50", "-"), ("p90", ":"), ("p99", "--")):
                ys = [run["metrics"][key][q] for run in ep["runs"]]
                ax.plot(xs, [float("nan") if y is None else y for y in ys], style, marker="o", color=color,
                        label=f"{name} {q}")
        _categorical(ax, labels, title, "ms")
    axes[0].legend(fontsize=7)
    written.append(_save(fig, plot_dir / "latency.png"))

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for k, (name, ep) in enumerate(endpoints.items()):
        m = [run["metrics"] for run in ep["runs"]]
        axes[0].plot(xs, [x["request_throughput"] for x in m], "-o", color=f"C{k}", label=f"{name} throughput")
        axes[0].plot(xs, [x["goodput"] for x in m], "--s", color=f"C{k}", label=f"{name} goodput")
        axes[1].plot(xs, [x["output_throughput"] for x in m], "-o", color=f"C{k}", label=name)
    _categorical(axes[0], labels, "requests/s", "req/s")
    _categorical(axes[1], labels, "output tokens/s", "tok/s")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    written.append(_save(fig, plot_dir / "throughput.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    styles = ["-", "--", ":", "-."]
    for k, name in enumerate(endpoints):
        for j, label in enumerate(labels):
            ts = ttft_samples.get((name, label)) or []
            if ts:
                ax.step([1e3 * t for t in ts], [(i + 1) / len(ts) for i in range(len(ts))], where="post",
                        linestyle=styles[j % len(styles)], color=f"C{k}", label=f"{name} {label}")
    lows = [t for ts in ttft_samples.values() if ts for t in ts[:1]]
    highs = [t for ts in ttft_samples.values() if ts for t in ts[-1:]]
    if lows and min(lows) > 0 and max(highs) / min(lows) > 30:  # queueing tails: a log axis keeps the body visible
        ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    written.append(_save(fig, plot_dir / "ttft_cdf.png"))
    broken = {name: ep for name, ep in endpoints.items()
              if any(run["metrics"].get("ttft_breakdown") for run in ep["runs"])}
    if broken:
        written.append(_breakdown_plot(plot_dir / "ttft_breakdown.png", broken, labels))
    return written


def _breakdown_plot(path: Path, endpoints: dict, labels: list[str]) -> Path:
    """Per endpoint, a stacked bar per load point: the mean of each TTFT part (ms), beside
    the p99 of the whole TTFT and the parts of the slowest tenth."""
    import matplotlib.pyplot as plt

    from .metrics import BREAKDOWN
    fig, axes = plt.subplots(len(endpoints), 2, figsize=(11, 3.8 * len(endpoints)), squeeze=False)
    for row, (name, ep) in zip(axes, endpoints.items()):
        for ax, key, title in ((row[0], "mean", "mean"), (row[1], "tail", "slowest 10% (mean)")):
            bottom = [0.0] * len(ep["runs"])
            for k, (part, pname) in enumerate(BREAKDOWN):
                ys = []
                for run in ep["runs"]:
                    b = run["metrics"].get("ttft_breakdown")
                    ys.append(0.0 if not b else b["parts_ms"][part]["mean"] if key == "mean" else b["tail_mean_ms"][part])
                ax.bar(range(len(ys)), ys, bottom=bottom, color=f"C{k}", label=pname)
                bottom = [a + b for a, b in zip(bottom, ys)]
            if key == "tail":
                ax.plot(range(len(ep["runs"])), [run["metrics"]["ttft_ms"]["p99"] or float("nan") for run in ep["runs"]],
                        "k--o", label="TTFT p99")
            _categorical(ax, labels, f"{name}: TTFT parts, {title}", "ms")
        row[0].legend(fontsize=7)
        row[1].legend(fontsize=7)
    return _save(fig, path)


def _categorical(ax, labels: list[str], title: str, unit: str) -> None:
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_title(title)
    ax.set_ylabel(unit)
    ax.set_xlabel("offered load")
    ax.grid(alpha=0.3)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
