"""The figures `--plot PATH` writes: one function per figure, plain numbers in, an image out.

The format follows the file's extension (.png or .svg). `check_plot_path` validates a path before a command
does its work, so a typo costs nothing; matplotlib is imported only when a figure is drawn."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

FORMATS = {".png": "png", ".svg": "svg"}
DPI = 120
GiB = 1024**3
KVSERVE_COLOR = "#1f6feb"
BASELINE_COLOR = "#8b949e"
DTYPE_COLORS = ["#1f6feb", "#d29922", "#2da44e", "#a371f7", "#cf222e", "#6e7781"]
LINE_STYLES = ["-", "--", "-", "-.", ":"]  # dtypes of almost the same size (fp8, int8) stay apart


def check_plot_path(path: str | Path) -> Path:
    """`path` if a figure can be written there: a .png or .svg name in an existing directory; else ValueError."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"--plot {path}: the name must end in .png or .svg (the image format follows the extension)")
    if path.is_dir():
        raise ValueError(f"--plot {path}: that is a directory; give a file name ending in .png or .svg")
    if not path.parent.is_dir():
        raise ValueError(f"--plot {path}: the directory {path.parent} does not exist")
    return path


def plot_plan(path: str | Path, title: str, memory_split: Sequence[tuple[str, int]],
              concurrency: dict[str, Sequence[tuple[int, float]]], max_model_len: int) -> Path:
    """Left: GPU memory split into (label, bytes) parts. Right: requests that fit at once against context
    length, one line per KV dtype (the first is the one planned; none when no memory is left for KV)."""
    fig = _figure(11, 4.2)
    memory, lines = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 2.2]})
    _memory_bar(memory, memory_split)
    for index, (dtype, points) in enumerate(concurrency.items()):
        tokens, requests = zip(*points)
        lines.plot(tokens, requests, label=dtype, color=DTYPE_COLORS[index % len(DTYPE_COLORS)],
                   linestyle=LINE_STYLES[index % len(LINE_STYLES)], linewidth=2.4 if index == 0 else 1.6,
                   zorder=3 + len(concurrency) - index)  # the earlier, planned dtypes on top
    lines.set(title="Maximum concurrency by KV cache dtype")
    if concurrency:
        from matplotlib.ticker import FuncFormatter

        lines.axhline(1, color=BASELINE_COLOR, linewidth=1, linestyle=":")
        lines.text(0.4, 1, "one request", transform=lines.get_yaxis_transform(), va="bottom", fontsize=8,
                   color="#57606a")
        lines.axvline(max_model_len, color=BASELINE_COLOR, linewidth=1, linestyle="--")
        lines.text(max_model_len, 0.98, f"max_model_len {max_model_len:,} ", transform=lines.get_xaxis_transform(),
                   ha="right", va="top", fontsize=8, color="#57606a")
        lines.set(xscale="log", yscale="log", xlabel="tokens per request (context length)",
                  ylabel="requests that fit at once")
        plain = FuncFormatter(lambda value, _: f"{value:,g}" if value < 1e6 else f"{value:,.0f}")
        lines.xaxis.set_major_formatter(plain)
        lines.yaxis.set_major_formatter(plain)
        lines.legend(title="KV dtype", fontsize=8, title_fontsize=8, loc="lower left")
        lines.grid(True, which="major", alpha=0.3)
    else:
        lines.text(0.5, 0.5, "no memory is left for the KV cache", ha="center", va="center",
                   transform=lines.transAxes)
    fig.suptitle(title, fontsize=11)
    return _save(fig, path)


def _memory_bar(ax, memory_split: Sequence[tuple[str, int]]) -> None:
    colors = {"weights": "#6e7781", "KV cache": KVSERVE_COLOR, "other": "#d29922", "unused": "#eaeef2"}
    bottom = 0.0
    for label, size_bytes in memory_split:
        gib = size_bytes / GiB
        ax.bar(0, gib, bottom=bottom, width=0.6, color=colors.get(label, "#a371f7"), edgecolor="white")
        if gib > 0:
            ax.text(0.36, bottom + gib / 2, f"{label}\n{gib:,.1f} GiB", va="center", fontsize=8)
        bottom += gib
    ax.set(xlim=(-0.5, 1.4), ylim=(0, bottom * 1.02), ylabel="GiB", title="GPU memory")
    ax.set_xticks([])
    ax.spines[["top", "right", "bottom"]].set_visible(False)


def plot_multiturn(path: str | Path, prompt_tokens: Sequence[int], prefilled_cached: Sequence[int],
                   prefilled_uncached: Sequence[int]) -> Path:
    """Prompt tokens prefilled (computed) at each turn of one conversation, with and without prefix caching."""
    fig = _figure(8, 4.2)
    ax = fig.subplots()
    turns = list(range(1, len(prompt_tokens) + 1))
    width = 0.38
    ax.bar([t - width / 2 for t in turns], prefilled_uncached, width, label="no prefix caching", color=BASELINE_COLOR)
    ax.bar([t + width / 2 for t in turns], prefilled_cached, width, label="prefix caching", color=KVSERVE_COLOR)
    ax.plot(turns, prompt_tokens, color="#57606a", linestyle=":", marker=".", label="prompt length")
    ax.set(xlabel="turn", ylabel="tokens prefilled", xticks=turns,
           title="Multi-turn conversation: prompt tokens computed per turn")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)
    return _save(fig, path)


def plot_tiers(path: str | Path, title: str, returning_ttft_s: dict[str, Sequence[tuple[int, float]]],
               prefilled_tokens: dict[str, int], new_input_tokens: int) -> Path:
    """Left: time to first token of each returning turn against its history length, one colour per run (a dot a
    turn, a line through each history length's median). Right: prompt tokens computed per run against the new
    input tokens (first prompts and questions), which any run must compute."""
    from statistics import median

    from matplotlib.ticker import StrMethodFormatter

    fig = _figure(11, 4.2)
    ttft, bars = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.6, 1]})
    colors = [BASELINE_COLOR, KVSERVE_COLOR, "#2da44e", *DTYPE_COLORS[1:]]
    for index, (name, points) in enumerate(returning_ttft_s.items()):
        color, style = colors[index % len(colors)], LINE_STYLES[index % len(LINE_STYLES)]
        ttft.scatter([h for h, _ in points], [s * 1e3 for _, s in points], color=color, s=10, alpha=0.35,
                     linewidths=0)
        histories = sorted({h for h, _ in points})
        medians = [median(s * 1e3 for h, s in points if h == history) for history in histories]
        ttft.plot(histories, medians, color=color, linestyle=style, marker="o", markersize=4, label=name)
    ttft.set(xlabel="history tokens (cached or recomputed)", ylabel="time to first token, ms", ylim=(0, None),
             title="Returning turns: time to first token")
    ttft.legend(fontsize=8)
    ttft.grid(True, alpha=0.3)
    names = list(prefilled_tokens)
    values = [prefilled_tokens[n] for n in names]
    drawn = bars.bar(range(len(names)), values, color=[colors[i % len(colors)] for i in range(len(names))])
    bars.bar_label(drawn, labels=[f"{v:,}\n{v / new_input_tokens:.2f}x" for v in values], padding=3, fontsize=8)
    bars.axhline(new_input_tokens, color="#57606a", linewidth=1, linestyle="--",
                 label=f"new input tokens ({new_input_tokens:,})")
    bars.legend(fontsize=8, loc="upper right")
    bars.set_xticks(range(len(names)), [n.replace(", ", ",\n") for n in names], fontsize=8)
    bars.set(ylabel="prompt tokens computed", ylim=(0, max(values + [new_input_tokens]) * 1.2),
             title="Prompt tokens computed")
    bars.spines[["top", "right"]].set_visible(False)
    for ax in (ttft, bars):
        ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    fig.suptitle(title, fontsize=11)
    return _save(fig, path)


def plot_throughput(path: str | Path, batched: dict[str, float], single: dict[str, float]) -> Path:
    """Output tokens/s of each engine that ran: batched, and for one stream (`single` may be empty)."""
    panels = [("Batched", batched)] + ([("Single stream", single)] if single else [])
    fig = _figure(9, 1.2 + 0.42 * sum(len(speeds) for _, speeds in panels))
    axes = fig.subplots(len(panels), 1, squeeze=False, gridspec_kw={"height_ratios": [len(s) for _, s in panels]})
    for ax, (name, speeds) in zip(axes[:, 0], panels):
        names = list(speeds)[::-1]  # the first engine on top
        values = [speeds[n] for n in names]
        colors = [KVSERVE_COLOR if n.startswith("kvserve") else BASELINE_COLOR for n in names]
        bars = ax.barh(names, values, color=colors)
        ax.bar_label(bars, labels=[f"{v:,.1f}" for v in values], padding=3, fontsize=8)
        ax.set_title(f"{name}: output tokens/s", fontsize=10, loc="left")
        ax.set_xlim(0, max(values) * 1.15)
        ax.spines[["top", "right"]].set_visible(False)
    return _save(fig, path)


def plot_quality_vs_bytes(path: str | Path, title: str,
                          panels: dict[str, Sequence[tuple[str, float, float]]]) -> Path:
    """One panel per quality measure ({label: [(setting, KV bytes per token, value)]}), one labelled point per
    setting: what each setting costs against what it saves."""
    fig = _figure(5.5 * len(panels), 4.2)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (quality_label, points) in zip(axes, panels.items()):
        for index, (name, bytes_per_token, quality) in enumerate(points):
            ax.scatter(bytes_per_token, quality, color=DTYPE_COLORS[index % len(DTYPE_COLORS)], zorder=3)
            ax.annotate(name, (bytes_per_token, quality), xytext=(5, 4), textcoords="offset points", fontsize=8)
        ax.set(xscale="log", xlabel="KV cache bytes per token", ylabel=quality_label)
        ax.grid(True, alpha=0.3)
        ax.spines[["top", "right"]].set_visible(False)
    fig.suptitle(title)
    return _save(fig, path)


def _figure(width_in: float, height_in: float):
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    return Figure(figsize=(width_in, height_in), layout="constrained")


def _save(fig, path: str | Path) -> Path:
    path = check_plot_path(path)
    try:
        fig.savefig(path, format=FORMATS[path.suffix.lower()], dpi=DPI)
    except OSError as exc:
        raise ValueError(f"--plot {path}: cannot write it: {exc.strerror or exc}") from exc
    return path
