"""A PNG of a job's train and eval loss curves, read from its metrics.jsonl."""

from __future__ import annotations

import json
import os

from paxlite.errors import NotFoundError, SettingError


def read_metrics(job_dir: str) -> tuple[list[dict], list[dict]]:
    """(train lines, eval lines) of `job_dir/metrics.jsonl`; a resumed run's repeated steps keep the
    last value."""
    path = os.path.join(job_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise NotFoundError(f"{path} does not exist: is {job_dir} a paxlite job directory?")
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            target = evals if any(k.startswith("eval/") for k in record) else train
            target[record["step"]] = record
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)]


def plot_losses(job_dir: str, output: str | None = None) -> str:
    """Writes the loss curves (train loss per summary, eval loss per evaluation) and returns the PNG
    path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = read_metrics(job_dir)
    if not train and not evals:
        raise SettingError(f"{job_dir}/metrics.jsonl has no train or eval lines to plot")
    output = output or os.path.join(job_dir, "loss.png")
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", lw=1.5)
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [r["eval/loss"] for r in evals],
            "o-",
            label="validation loss",
            lw=1.5,
        )
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats/token)")
    ax.set_title(os.path.basename(os.path.normpath(job_dir)))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(output)
    plt.close(fig)
    return output
