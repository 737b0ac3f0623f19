"""PNG plots of the simulated experiments (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from orchestrator.sim.experiments import tokens_per_s  # noqa: E402
from orchestrator.sim.simulator import SimResult  # noqa: E402


def _title(ax, title: str) -> None:
    ax.set_title("\n".join(textwrap.wrap(title, 80)), fontsize=9)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def policies_bar(results: list[SimResult], path, title: str = "") -> Path:
    """Tokens/s (bars) and token-weighted hit rate (dots) for each policy."""
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(results) + 2), 4))
    names = [r.policy for r in results]
    x = np.arange(len(results))
    ax.bar(x, [r.tokens_per_s for r in results], color="tab:blue")
    ax.set_xticks(x, names, rotation=30, ha="right")
    ax.set_ylabel("tokens/s")
    hit = ax.twinx()
    hit.plot(x, [r.hit_rate for r in results], "o", color="tab:orange")
    hit.set_ylim(0, 1)
    hit.set_ylabel("hit rate (orange)")
    _title(ax, title)
    return _save(fig, path)


def cache_ratio_lines(sweep: dict[str, list], ratios, path, title: str = "") -> Path:
    """Fig. 5 left: tokens/s against the expert cache ratio, one line per policy."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, results in sweep.items():
        ax.plot(np.asarray(ratios) * 100, tokens_per_s(results), marker="o", label=name)
    ax.set_xlabel("expert cache ratio (%)")
    ax.set_ylabel("tokens/s")
    _title(ax, title)
    ax.legend(fontsize=8, ncol=2)
    return _save(fig, path)


def k_line(ks, results: list[SimResult], path, title: str = "") -> Path:
    """Fig. 5 right: MoE-SpAc tokens/s against the utility bound K."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(list(ks), tokens_per_s(results), marker="o")
    ax.set_xlabel("utility bound K")
    ax.set_ylabel("tokens/s")
    _title(ax, title)
    return _save(fig, path)
