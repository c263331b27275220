"""The diagnostics report: `report.json`, PNG plots (matplotlib, Agg backend) and `report.html`.

`write_report(out_dir, report, deltas)` takes a JSON-able dict with any of these sections and draws
the plot of each one present (docs/diagnostics.md says how to read them):

    metrics       mismatch_metrics of the learner vs sampler log-probs (a table in the HTML)
    (deltas)      per-token log pi - log mu of the response tokens -> delta_hist.png
    localization  Localization.to_dict()                            -> layer_divergence.png
    attribution   Attribution.to_dict()                             -> attribution_waterfall.png
    direction     direction(...) output                             -> regions.png
    heatmap       heatmap_rows(...) output                          -> heatmap.png
    curves        {"step": [...], name: [...]} metric curves        -> curves.png

`write_training_report(out_dir, history)` is what a training run calls at its end with its logged
metrics (a list of per-step dicts): it writes the same report with the metric curves over steps.
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

REGION_COLORS = {"amp_pos": "#d62728", "amp_neg": "#9467bd", "contracting": "#2ca02c", "neutral": "#7f7f7f"}
CURVE_METRICS = ("kl", "k3_kl", "logprob_abs_diff_mean", "chi2_token", "ess", "triage/imbalance")
FLOOR = 1e-9  # where exact zeros are drawn on log axes when nothing differs


def plot_delta_hist(deltas, path: Path) -> None:
    d = np.abs(np.asarray(deltas, dtype=np.float64))
    zeros, nz = int((d == 0).sum()), d[d > 0]
    fig, ax = plt.subplots(figsize=(7, 4))
    if nz.size:
        lo, hi = np.log10(nz.min()), np.log10(nz.max())
        bins = np.logspace(lo - 0.05, hi + 0.05, 40)
        ax.hist(nz, bins=bins, color="#1f77b4")
        ax.set_xscale("log")
    ax.set_xlabel("|log pi - log mu| per response token")
    ax.set_ylabel("tokens")
    ax.set_title(f"Histogram of |delta log-prob| ({d.size} tokens, {zeros} exactly 0)")
    if not nz.size:
        ax.text(0.5, 0.5, "all deltas are exactly 0 (bitwise equal)", ha="center", transform=ax.transAxes)
    _save(fig, path)


def plot_layer_divergence(loc: dict, path: Path) -> None:
    ops = [o for o in loc["ops"] if o["kind"] != "router"]
    nonzero = [o["rel_diff"] for o in ops if o["rel_diff"] > 0]
    floor = min(nonzero) / 10 if nonzero else FLOOR
    y = np.array([max(o["rel_diff"], floor) for o in ops])
    x = np.arange(len(ops))
    fig, ax = plt.subplots(figsize=(min(14, max(7, 0.3 * len(ops))), 4.5))
    ax.plot(x, y, "-o", color="#1f77b4", ms=3 if len(ops) <= 40 else 1.5, lw=1, label="every op")
    out = [i for i, o in enumerate(ops) if o["kind"] in ("output", "lm_head")]
    ax.plot(out, y[out], "s-", color="#d62728", ms=6, lw=2, label="residual stream after each layer, logits")
    if loc.get("first_divergent"):
        i = next(i for i, o in enumerate(ops) if o["op"] == loc["first_divergent"])
        ax.axvline(i, color="k", ls=":", lw=1, label=f"first divergent: {loc['first_divergent']}")
    ax.set_yscale("log")
    ax.set_ylabel(f"||a - b|| / ||b||  (0 drawn at {floor:.1g})")
    if len(ops) <= 40:  # every op named
        ax.set_xticks(x, [o["op"].removeprefix("layers.") for o in ops], rotation=90, fontsize=7)
    else:  # deep models: one tick per layer output (at most 40), then the final norm and logits
        step = math.ceil(len(out) / 40)
        ticks = out[:-1][::step] + out[-1:]
        ax.set_xticks(ticks, [ops[i]["op"].removesuffix(".output") for i in ticks], rotation=90, fontsize=7)
    ax.set_title(f"Per-op relative difference with depth: {loc['side_a']} vs {loc['side_b']}")
    ax.legend(fontsize=8, loc="lower right")
    _save(fig, path)


def plot_waterfall(att: dict, path: Path) -> None:
    metric, g0 = att["metric"], att["initial"][att["metric"]]
    names, bottoms, heights, colors = ["initial gap"], [0.0], [g0], ["#7f7f7f"]
    level = g0
    for r in att["rows"]:
        if r["status"] == "switched":
            names.append(f"{r['knob']}\n{r['from']}->{r['to']}"[:40])
            bottoms.append(level - r["closed"] if r["closed"] >= 0 else level)
            heights.append(abs(r["closed"]))
            colors.append("#2ca02c" if r["closed"] >= 0 else "#d62728")
            level -= r["closed"]
        else:
            names.append(f"{r['knob']}\n({r['status']})")
            bottoms.append(level)
            heights.append(0.0)
            colors.append("#cccccc")
    names.append("residual")
    bottoms.append(0.0)
    heights.append(att["residual"][metric])
    colors.append("#7f7f7f")
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(names)), 4.5))
    ax.bar(range(len(names)), heights, bottom=bottoms, color=colors, edgecolor="k", lw=0.5)
    for i, (b, h) in enumerate(zip(bottoms, heights)):
        if 0 < i < len(names) - 1 and h > 0:
            ax.text(i, b + h, f"{100 * h / g0:.0f}%" if g0 > 0 else "", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(metric)
    ax.set_title(f"Attribution waterfall: {metric} closed by each knob, in sequence "
                 "(green closes, red widens)", fontsize=10)
    _save(fig, path)


def plot_regions(d: dict, path: Path) -> None:
    names = list(REGION_COLORS)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    colors = [REGION_COLORS[n] for n in names]
    axes[0].bar(names, [d[f"share_{n}"] for n in names], color=colors)
    axes[0].set_title("token share per region")
    axes[1].bar(names, [d[f"mass_{n}"] for n in names], color=colors)
    axes[1].set_title(f"mass sum|A*g|; M-/M+ = {d['imbalance']:.3g}")
    prof = d["segment_profile"]
    k = [p["segment"] for p in prof]
    axes[2].bar(k, [p["tail"] for p in prof], color="#1f77b4", label="tail tokens")
    axes[2].bar(k, [p["amp_tail"] for p in prof], color="#d62728", label="amplifying tail tokens")
    axes[2].set_xticks(k)
    axes[2].set_xlabel(f"response segment ({d['segment_len']} tokens each)")
    axes[2].set_title(f"tails per segment; concentration {d['tail_concentration']:.2f}, tau {d['tau']:.3g}")
    axes[2].legend(fontsize=8)
    for ax in axes[:2]:
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("Direction: regions' token shares and masses, tail tokens across response segments")
    _save(fig, path)


def plot_heatmap(rows: list[dict], path: Path, max_tokens: int = 48) -> None:
    vmax = max([abs(g) for r in rows for g in r["gap"][:max_tokens]] + [1e-12])
    width = min(max_tokens, max(len(r["gap"]) for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 0.32 * width + 2), 0.6 * len(rows) + 1.4))
    grid = np.full((len(rows), width), np.nan)
    for i, r in enumerate(rows):
        g = r["gap"][:width]
        grid[i, : len(g)] = g
        for j, t in enumerate(r["tokens"][:width]):
            ax.text(j, i, t.replace("\n", "\\n") or " ", ha="center", va="center", fontsize=7)
    im = ax.imshow(grid, cmap="RdBu_r", vmin=-vmax, vmax=vmax, aspect="auto")
    adv = [f"#{r['row']}" + ("" if r["advantage"] is None else f" A={r['advantage']:+.2f}") for r in rows]
    ax.set_yticks(range(len(rows)), adv, fontsize=8)
    ax.set_xlabel("response token position")
    fig.colorbar(im, ax=ax, label="g = log pi - log mu")
    ax.set_title("Token heat-map of the responses with the largest total |gap| (red: pi > mu)")
    _save(fig, path)


def plot_curves(curves: dict, path: Path) -> None:
    names = [k for k in curves if k != "step"]
    steps = curves.get("step") or list(range(len(curves[names[0]])))
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.3 * cols, 3 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        ax.plot(steps, curves[name], lw=1.2)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.suptitle("Mismatch metrics over training steps")
    _save(fig, path)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


PLOTS = (  # section, file, drawer, caption
    ("deltas", "delta_hist.png", plot_delta_hist,
     "How far apart the two engines' log-probs are, token by token."),
    ("localization", "layer_divergence.png", plot_layer_divergence,
     "Where the divergence enters (first op above 0) and how it grows with depth."),
    ("attribution", "attribution_waterfall.png", plot_waterfall,
     "How much of the gap each execution knob closes when switched to the sampler's setting."),
    ("direction", "regions.png", plot_regions,
     "Whether the gap sits where the update would amplify it (amp_pos/amp_neg) and where in responses."),
    ("heatmap", "heatmap.png", plot_heatmap, "Where in individual responses the gap sits."),
    ("curves", "curves.png", plot_curves, "Mismatch metrics logged during training."),
)


def write_report(out_dir, report: dict, deltas=None, title: str = "miniTE diagnostics") -> dict[str, Path]:
    """Write report.json, the PNGs of the sections present and report.html; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = {**report, "deltas": None if deltas is None else [float(x) for x in np.asarray(deltas).ravel()]}
    paths = {}
    for section, file, draw, _ in PLOTS:
        if data.get(section):
            draw(data[section], out / file)
            paths[section] = out / file
    (out / "report.json").write_text(json.dumps(_jsonable(report), indent=1))
    paths["json"] = out / "report.json"
    (out / "report.html").write_text(_html(title, report, paths))
    paths["html"] = out / "report.html"
    return paths


def write_training_report(out_dir, history: list[dict], report: dict | None = None,
                          metrics=CURVE_METRICS) -> dict[str, Path]:
    """Report of a training run: `history` holds one dict of logged metrics per step (an optional
    "step" key); the curves of `metrics` that were logged are drawn, plus any sections of `report`."""
    steps = [h.get("step", i) for i, h in enumerate(history)]
    curves = {"step": steps}
    for name in metrics:
        values = [h.get(name, h.get(f"mismatch/{name}")) for h in history]
        if history and all(v is not None for v in values):
            curves[name] = [float(v) for v in values]
    return write_report(out_dir, {**(report or {}), "curves": curves if len(curves) > 1 else None},
                        title="miniTE training report")


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def _table(d: dict) -> str:
    cells = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{_fmt(v)}</td></tr>" for k, v in d.items()
                    if not isinstance(v, list | dict))
    return f"<table>{cells}</table>"


def _fmt(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else html.escape(str(v))


def _html(title: str, report: dict, paths: dict) -> str:
    parts = [f"<html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>"
             "body{font-family:sans-serif;max-width:1100px;margin:auto} td{padding:2px 10px}"
             "table{border-collapse:collapse} tr:nth-child(even){background:#f3f3f3}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>"]
    if report.get("config"):
        parts.append("<h2>setup</h2>" + _table(report["config"]))
    if report.get("metrics"):
        parts.append("<h2>token-level mismatch</h2>" + _table(report["metrics"]))
    if report.get("attribution"):
        rows = "".join(f"<tr><td>{r['knob']}</td><td>{r['status']}</td><td>{r.get('from', '')} &rarr; "
                       f"{r.get('to', '')}</td><td>{_pct(r.get('closed_frac'))}</td>"
                       f"<td>{_pct(r.get('alone_closed_frac'))}</td><td>{html.escape(r.get('reason') or '')}"
                       "</td></tr>" for r in report["attribution"]["rows"])
        parts.append("<h2>attribution</h2><table><tr><th>knob</th><th>status</th><th>setting</th>"
                     f"<th>closed (in sequence)</th><th>closed (alone)</th><th>note</th></tr>{rows}</table>")
    if report.get("direction"):
        parts.append("<h2>direction</h2>" + _table(report["direction"]))
    for section, file, _, caption in PLOTS:
        if section in paths:
            b64 = base64.b64encode(paths[section].read_bytes()).decode()
            parts.append(f"<h3>{file}</h3><p>{html.escape(caption)}</p>"
                         f"<img src='data:image/png;base64,{b64}'>")
    return "\n".join(parts + ["</body></html>"])


def _pct(x) -> str:
    return "" if x is None else f"{100 * x:.1f}%"
