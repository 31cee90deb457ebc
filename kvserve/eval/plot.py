"""`kvserve eval --plot`: quality lost (Δppl, KLD) against bytes per token, one point per setting."""
from __future__ import annotations

from pathlib import Path

FORMATS = (".png", ".svg")


def check_plot_path(path: str) -> None:
    """Raise ValueError before any work if the figure could not be written there."""
    target = Path(path)
    if target.suffix.lower() not in FORMATS:
        raise ValueError(f"--plot {path!r}: the file name must end in {' or '.join(FORMATS)}")
    if not target.parent.is_dir():
        raise ValueError(f"--plot {path!r}: directory {str(target.parent)!r} does not exist")


def plot_quality(rows, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.bytes_per_token and r.ppl is not None]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for ax, key, label in ((axes[0], "delta_ppl_pct", "Δ perplexity vs reference (%)"),
                           (axes[1], "kld", "mean KL divergence vs reference")):
        for row in shown:
            value = getattr(row, key)
            if value is None:
                continue
            ax.scatter(row.bytes_per_token, value, s=40)
            ax.annotate(row.setting.label, (row.bytes_per_token, value), textcoords="offset points", xytext=(5, 5),
                        fontsize=8)
        ax.set_xlabel("KV bytes per token")
        ax.set_ylabel(label)
        ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path)
    plt.close(fig)
