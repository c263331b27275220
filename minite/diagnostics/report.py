"""The diagnostics report: `report.json`, PNG plots (matplotlib, Agg backend) and `report.html`.

`write_report(out_dir, report, deltas)` takes a JSON-able dict with any of these sections and draws
the plot of each one present (docs/diagnostics.md says how to read them):

    metrics       mismatch_metrics of the learner vs sampler log-probs (a table in the HTML)
    distribution  metrics over a rollout file's top-k log-probs (`minite.diagnostics.topk`; a table)
    (deltas)      per-token log pi - log mu of the response tokens -> delta_hist.png
    localization  Localization.to_dict()                            -> layer_divergence.png
    attribution   Attribution.to_dict()                             -> attribution_waterfall.png
    direction     direction(...) output                             -> regions.png
    heatmap       heatmap_rows(...) output                          -> heatmap.png
    training      training_section(...): reward, held-out accuracy,
                  mismatch and throughput over RL steps              -> training.png
    curves        {"step": [...], name: [...]} metric curves        -> curves.png
    summary       a run's summary numbers (a table in the HTML)

`write_training_report(out_dir, history)` is what a training run calls at its end with its logged
records (one dict per RL step, "kind" "rl", and per evaluation, "kind" "eval"): the summary table,
the training curves and every mismatch metric over steps on a readable scale (`CURVE_SCALES`).
Every file is written whole or not at all (`minite.files.write_atomic`).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from minite.files import make_dir, write_atomic  # noqa: E402

REGION_COLORS = {"amp_pos": "#d62728", "amp_neg": "#9467bd", "contracting": "#2ca02c", "neutral": "#7f7f7f"}
CURVE_METRICS = ("kl", "k3_kl", "logprob_abs_diff_mean", "logprob_abs_diff_max", "chi2_token", "ess",
                 "triage/imbalance")
# How each curve is drawn: "log" (zeros at a floor named in the title), "abs_log" (|x| on a log axis,
# negative steps marked: an estimate whose sign is noise when the engines nearly agree), "unit"
# (a share on a fixed 0..1 axis), "linear".
CURVE_SCALES = {"kl": "abs_log", "k3_kl": "log", "logprob_abs_diff_mean": "log",
                "logprob_abs_diff_max": "log", "chi2_token": "abs_log", "ess": "unit",
                "triage/imbalance": "log"}
FLOOR = 1e-9  # where exact zeros are drawn on log axes when nothing differs
TRAINING_PNG = "training.png"
# training-section key -> (the logged record's key, label)
TRAINING_KEYS = {"reward": ("reward", "rollout reward"),
                 "k3_kl": ("mismatch/k3_kl", "k3_kl"),
                 "logprob_abs_diff_max": ("mismatch/logprob_abs_diff_max", "max |delta log-prob|"),
                 "rollout_tokens_per_s": ("rollout/tokens_per_s", "rollout (sampler)"),
                 "learner_tokens_per_s": ("learner/tokens_per_s", "learner update")}
EVAL_KEYS = {"eval_accuracy": ("eval/accuracy", "greedy accuracy"),
             "eval_sampled_reward": ("eval/sampled_reward", "sampled reward")}


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


def _finite(steps, values) -> tuple[np.ndarray, np.ndarray]:
    x, y = np.asarray(steps, dtype=np.float64), np.asarray(values, dtype=np.float64)
    keep = np.isfinite(y)
    return x[keep], y[keep]


def _log_curve(ax, steps, values, label: str | None = None, **style) -> str:
    """`values` (>= 0) on a log axis, exact zeros drawn at a floor a decade under the smallest
    nonzero value; returns a note for the title ("" when nothing was zero)."""
    x, y = _finite(steps, values)
    nonzero = y[y > 0]
    floor = nonzero.min() / 10 if nonzero.size else FLOOR
    ax.plot(x, np.maximum(y, floor), label=label, **style)
    ax.set_yscale("log")
    if y.size and not nonzero.size and not ax.texts:  # once per panel, above the floor line
        ax.text(0.5, 0.75, "exactly 0 at every step (bitwise equal)", ha="center", transform=ax.transAxes,
                fontsize=8)
    return f"0 drawn at {floor:.1g}" if (y == 0).any() else ""


def _draw_curve(ax, name: str, steps, values) -> str:
    """One mismatch metric on its scale (`CURVE_SCALES`); returns the panel's title."""
    scale = CURVE_SCALES.get(name, "linear")
    if scale == "log":
        note = _log_curve(ax, steps, values, lw=1.2)
        return f"{name} (log{'; ' + note if note else ''})"
    if scale == "abs_log":
        x, y = _finite(steps, values)
        note = _log_curve(ax, x, np.abs(y), lw=1.2, label=f"|{name}|")
        if (y < 0).any():
            ax.plot(x[y < 0], -y[y < 0], "v", color="#d62728", ms=4, label="step where it is < 0")
            ax.legend(fontsize=7)
        return f"|{name}| (log{'; ' + note if note else ''})"
    x, y = _finite(steps, values)
    ax.plot(x, y, lw=1.2)
    if scale == "unit":
        ax.set_ylim(0, 1.02)
        ax.ticklabel_format(axis="y", useOffset=False)
        return f"{name} (0..1; min {y.min():.4g})" if y.size else name
    return name


def plot_curves(curves: dict, path: Path) -> None:
    names = [k for k in curves if k != "step"]
    steps = curves.get("step") or list(range(len(curves[names[0]])))
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.3 * cols, 3 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        ax.set_title(_draw_curve(ax, name, steps, curves[name]), fontsize=9)
        ax.set_xlabel("RL step", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.suptitle("Learner vs sampler mismatch over training steps")
    _save(fig, path)


def training_section(history: list[dict]) -> dict | None:
    """The training curves of a run's records: RL steps ("kind" "rl", or no kind) and evaluations
    ("kind" "eval"); None when no RL step logged a reward."""
    rl = [h for h in history if h.get("kind", "rl") == "rl" and "reward" in h]
    ev = [h for h in history if h.get("kind") == "eval"]
    if not rl:
        return None
    out = {"step": [h["step"] for h in rl]}
    for key, (logged, _) in TRAINING_KEYS.items():
        if all(logged in h for h in rl):
            out[key] = [float(h[logged]) for h in rl]
    out["eval_step"] = [h["step"] for h in ev]
    for key, (logged, _) in EVAL_KEYS.items():
        if ev and all(logged in h for h in ev):
            out[key] = [float(h[logged]) for h in ev]
    return out


def plot_training(t: dict, path: Path) -> None:
    """Reward, held-out accuracy, the mismatch summary and throughput over RL steps (2 x 2)."""
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))
    (reward, held_out), (mismatch, speed) = axes
    steps, rewards = t["step"], t["reward"]
    w = len(rewards) // 10
    reward.plot(steps, rewards, alpha=0.4 if w > 1 else 1.0, label="rollout reward (batch mean)")
    if w > 1:
        smooth = [float(np.mean(rewards[max(0, i - w + 1):i + 1])) for i in range(len(rewards))]
        reward.plot(steps, smooth, label=f"mean of the last {w}")
    reward.set(title="reward", xlabel="RL step")
    for key, (_, label) in EVAL_KEYS.items():
        if t.get(key):
            held_out.plot(t["eval_step"], t[key], "o-" if key == "eval_accuracy" else "s--", label=label)
    if not t.get("eval_accuracy"):
        held_out.text(0.5, 0.5, "no evaluation logged", ha="center", transform=held_out.transAxes)
    held_out.set(title="held-out accuracy", xlabel="RL step", ylim=(0, 1.02))
    notes = [note for key in ("k3_kl", "logprob_abs_diff_max") if t.get(key)
             for note in [_log_curve(mismatch, steps, t[key], TRAINING_KEYS[key][1])] if note]
    mismatch.set(title="learner vs sampler mismatch (log" + (f"; {notes[0]}" if notes else "") + ")",
                 xlabel="RL step")
    for key in ("rollout_tokens_per_s", "learner_tokens_per_s"):
        if t.get(key):
            speed.plot(steps, t[key], label=TRAINING_KEYS[key][1])
    speed.set(title="throughput (tokens/s)", xlabel="RL step", ylim=(0, None))
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    _save(fig, path)


def _save(fig, path: Path) -> None:
    """Render to memory, then write the file whole (a full disk leaves any previous file intact)."""
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    write_atomic(path, buf.getvalue())


PLOTS = (  # section, file, drawer, caption
    ("training", TRAINING_PNG, plot_training,
     "Rollout reward (batch mean and its running mean), greedy accuracy on the held-out split, the "
     "learner-sampler mismatch (k3_kl and max |delta log-prob|, log axis) and tokens per second of "
     "the rollout and of the learner update, per RL step."),
    ("deltas", "delta_hist.png", plot_delta_hist,
     "How far apart the two engines' log-probs are, token by token."),
    ("localization", "layer_divergence.png", plot_layer_divergence,
     "Where the divergence enters (first op above 0) and how it grows with depth."),
    ("attribution", "attribution_waterfall.png", plot_waterfall,
     "How much of the gap each execution knob closes when switched to the sampler's setting."),
    ("direction", "regions.png", plot_regions,
     "Whether the gap sits where the update would amplify it (amp_pos/amp_neg) and where in responses."),
    ("heatmap", "heatmap.png", plot_heatmap, "Where in individual responses the gap sits."),
    ("curves", "curves.png", plot_curves,
     "Mismatch metrics logged during training. Log axes draw exact zeros at the floor named in the "
     "panel's title. kl is the k1 estimate mean(log mu - log pi) over the sampled tokens: unbiased, but "
     "its terms take both signs, so when the engines nearly agree it is mostly noise and can be "
     "negative; it is drawn as |kl| with those steps marked (k3_kl is the estimate that is never "
     "negative), chi2_token likewise. ESS is a share on a 0..1 axis: 1 means the importance weights "
     "pi/mu are all equal."),
)


def write_report(out_dir, report: dict, deltas=None, title: str = "miniTE diagnostics") -> dict[str, Path]:
    """Write report.json, the PNGs of the sections present and report.html; returns their paths."""
    out = make_dir(out_dir)
    data = {**report, "deltas": None if deltas is None else [float(x) for x in np.asarray(deltas).ravel()]}
    paths = {}
    for section, file, draw, _ in PLOTS:
        if data.get(section):
            draw(data[section], out / file)
            paths[section] = out / file
    write_atomic(out / "report.json", json.dumps(_jsonable(report), indent=1))
    paths["json"] = out / "report.json"
    write_atomic(out / "report.html", _html(title, report, paths))
    paths["html"] = out / "report.html"
    return paths


def write_training_report(out_dir, history: list[dict], report: dict | None = None,
                          metrics=CURVE_METRICS) -> dict[str, Path]:
    """Report of a training run: `history` holds its logged records, one dict per RL step (an optional
    "step" key; "kind" "rl" or none) and per evaluation ("kind" "eval"); draws the training curves, the
    curves of the `metrics` that were logged, plus any sections of `report` (a "summary" dict is
    shown as a table)."""
    rl = [h for h in history if h.get("kind", "rl") == "rl"]
    steps = [h.get("step", i) for i, h in enumerate(rl)]
    curves = {"step": steps}
    for name in metrics:
        values = [h.get(name, h.get(f"mismatch/{name}")) for h in rl]
        if rl and all(v is not None for v in values):
            curves[name] = [float(v) for v in values]
    sections = {**(report or {}), "training": training_section(history),
                "curves": curves if len(curves) > 1 else None}
    return write_report(out_dir, sections, title="miniTE training report")


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
    if report.get("summary"):
        parts.append("<h2>summary</h2>" + _table(report["summary"]))
    if report.get("config"):
        parts.append("<h2>setup</h2>" + _table(report["config"]))
    if report.get("metrics"):
        parts.append("<h2>token-level mismatch</h2>" + _table(report["metrics"]))
    if report.get("distribution"):
        parts.append("<h2>distribution over the sampler's top-k</h2>" + _table(report["distribution"]))
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
