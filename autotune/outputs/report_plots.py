"""The report's Plotly figures, one function per question a user asks of a search.

Each builder takes the parsed trials (and the summary where it needs more) and returns a
figure, or None when the search measured nothing it could show; the HTML writer then
leaves the panel out instead of drawing an empty chart.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autotune import knobs
from autotune.config import BATCH
from autotune.records import PRUNED, Record

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from autotune.summary import Summary

MiB = 1024**2
GiB = 1024**3

# One colour per outcome, the same in every figure and in the table's status pills.
STATUS_COLORS: dict[str, str] = {
    "ok": "#2a9d8f", "oom": "#e63946", "nan": "#f4a261", "error": "#8e5ad8",
    "timeout": "#a47551", "crashed": "#343a40", "pruned": "#adb5bd", "lost": "#6c757d",
}
COMPONENT_COLORS = ("#264653", "#2a9d8f", "#8ab17d", "#e9c46a", "#f4a261", "#e76f51",
                    "#9c6644", "#6d597a", "#b5838d")
FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif"


def shown_knobs(trials: list[Record]) -> list[knobs.Knob]:
    """The knobs the trials varied, in table order: a knob every trial left at one value
    says nothing in a table column or a plot panel (the space's fixed values are listed
    with the best config)."""
    return [k for k in knobs.table()
            if len({getattr(t.config, k.name) for t in trials}) > 1] or list(knobs.table()[:1])


def grid_knobs(trials: list[Record]) -> list[tuple[str, str]]:
    """(attribute, title) of each knob's panel in the effects grid: the varied ones, then
    batch."""
    return [(k.name, k.label) for k in shown_knobs(trials)] + [(BATCH, "per-device batch")]


def shown_memory(t: Record) -> float | None:
    """Measured peak; a pruned trial never ran, so its predicted peak stands in."""
    if t.outcome.status == PRUNED:
        return known(t.outcome.predicted_memory_bytes)
    return known(t.outcome.peak_memory_bytes)


def known(value: Any) -> float | None:
    """A measured figure, or None; a negative placeholder (-1) counts as not measured."""
    if value is None or isinstance(value, bool):
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if v >= 0 else None


def memory_unit(values: Sequence[float | None]) -> tuple[float, str]:
    """MiB for the small models of a laptop run, GiB for everything else."""
    top = max((v for v in values if v is not None), default=0.0)
    return (GiB, "GiB") if top >= GiB else (MiB, "MiB")


def pareto_front(trials: Sequence[Record]) -> list[Record]:
    """Successful trials no other beats on both throughput and memory (less memory first)."""
    ok = [t for t in trials if t.outcome.ok and t.throughput is not None
          and shown_memory(t) is not None]
    front: list[Record] = []
    for t in sorted(ok, key=lambda t: (shown_memory(t), -(t.throughput or 0.0))):
        if not front or (t.throughput or 0.0) > (front[-1].throughput or 0.0):
            front.append(t)
    return front


def _layout(fig: go.Figure, title: str, height: int = 380, **kw: Any) -> go.Figure:
    base: dict[str, Any] = {
        "title": {"text": title, "x": 0.01, "font": {"size": 15}}, "template": "plotly_white",
        "height": height, "margin": {"l": 60, "r": 20, "t": 48, "b": 48},
        "font": {"family": FONT, "size": 12}, "legend": {"orientation": "h", "y": -0.2},
        "hoverlabel": {"font": {"family": FONT}}}
    fig.update_layout(base | kw)
    return fig


def _hover(t: Record, div: float, unit: str) -> str:
    thr = f"{t.throughput:,.1f} samples/s" if t.throughput is not None else "no throughput"
    memory = shown_memory(t)
    mem = f"{memory / div:,.2f} {unit}" if memory is not None else "memory not measured"
    what = "predicted " if not t.outcome.ran else ""
    return (f"#{t.number} {t.config.label()}<br>{t.outcome.status} · {thr}<br>"
            f"{what}peak {mem}<br>{t.reason}")


def throughput_vs_memory(trials: Sequence[Record], limit: float | None,
                         marks: dict[str, int | None] | None = None) -> go.Figure | None:
    """Where the fast configs sit against the memory limit; failed ones drawn at 0."""
    import plotly.graph_objects as go

    placed = [t for t in trials if shown_memory(t) is not None]
    if not placed:
        return None
    div, unit = memory_unit([shown_memory(t) for t in placed] + [limit])
    fig = go.Figure()
    for status, color in STATUS_COLORS.items():
        group = [t for t in placed if t.outcome.status == status]
        if not group:
            continue
        fig.add_trace(go.Scatter(
            x=[(shown_memory(t) or 0) / div for t in group], y=[t.throughput or 0 for t in group],
            mode="markers", name=status, hovertext=[_hover(t, div, unit) for t in group],
            hoverinfo="text", marker={"color": color, "size": 11, "opacity": 0.85,
                                      "symbol": "circle" if status == "ok" else "x",
                                      "line": {"width": 1, "color": "white"}}))
    front = pareto_front(trials)
    if front:
        fig.add_trace(go.Scatter(
            x=[(shown_memory(t) or 0) / div for t in front], y=[t.throughput for t in front],
            mode="lines", name="Pareto front", hoverinfo="skip",
            line={"color": "#264653", "dash": "dot", "shape": "hv", "width": 1.5}))
    if limit:
        fig.add_vline(x=limit / div, line={"color": "#e63946", "dash": "dash", "width": 1.5},
                      annotation_text="memory limit", annotation_position="top left",
                      annotation_font_color="#e63946")
    for text, number in (marks or {}).items():  # point out the winner and the baseline
        t = next((t for t in placed if t.number == number and t.throughput), None)
        if t is not None:
            fig.add_annotation(x=(shown_memory(t) or 0) / div, y=t.throughput, text=text,
                               showarrow=True, arrowhead=0, ax=-34 if text == "best" else 30,
                               ay=-22, font={"size": 11, "color": "#264653"})
    top = max((t.throughput or 0.0 for t in placed), default=0.0) or 1.0
    # A little room below 0 so the failed trials' markers sit clear of the axis line.
    return _layout(fig, "Throughput vs peak memory", xaxis_title=f"peak memory ({unit})",
                   yaxis_title="samples/s", xaxis_rangemode="tozero",
                   yaxis_range=[-0.07 * top, 1.1 * top])


def predicted_vs_measured(trials: Sequence[Record]) -> go.Figure | None:
    """How far the memory model was off, trial by trial; points above y=x were underestimated."""
    import plotly.graph_objects as go

    pairs = [t for t in trials if t.outcome.ran
             and known(t.outcome.predicted_memory_bytes) is not None
             and known(t.outcome.peak_memory_bytes) is not None]
    if not pairs:
        return None
    values = [float(t.outcome.predicted_memory_bytes or 0) for t in pairs] + [
        float(t.outcome.peak_memory_bytes or 0) for t in pairs]
    div, unit = memory_unit(values)
    fig = go.Figure()
    top = max(values) / div * 1.08
    fig.add_trace(go.Scatter(x=[0, top], y=[0, top], mode="lines", name="y = x",
                             hoverinfo="skip", line={"color": "#adb5bd", "dash": "dash"}))
    for status, color in STATUS_COLORS.items():
        group = [t for t in pairs if t.outcome.status == status]
        if group:
            fig.add_trace(go.Scatter(
                x=[(t.outcome.predicted_memory_bytes or 0) / div for t in group],
                y=[(t.outcome.peak_memory_bytes or 0) / div for t in group],
                mode="markers", name=status, marker={"color": color, "size": 10},
                hovertext=[_hover(t, div, unit) for t in group], hoverinfo="text"))
    return _layout(fig, "Predicted vs measured peak memory",
                   xaxis_title=f"predicted ({unit})", yaxis_title=f"measured ({unit})",
                   xaxis_range=[0, top], yaxis_range=[0, top])


def memory_components(summary: Summary) -> go.Figure | None:
    """What the winner's memory is made of (the memory model's terms), against the limit."""
    import plotly.graph_objects as go

    limit = known(summary.memory_limit_bytes)
    parts = {k: known(v) for k, v in (summary.memory_components or {}).items()}
    parts = {k: v for k, v in parts.items() if v and k not in ("total", "peak")}  # no sums
    if not parts or summary.best is None:
        return None
    peak = known(summary.best.outcome.peak_memory_bytes)
    div, unit = memory_unit([sum(parts.values()), limit, peak])
    fig = go.Figure()
    for i, (name, value) in enumerate(parts.items()):
        fig.add_trace(go.Bar(
            y=["best"], x=[value / div], name=name, orientation="h", width=0.45,
            marker_color=COMPONENT_COLORS[i % len(COMPONENT_COLORS)],
            hovertemplate=f"{name}: %{{x:,.2f}} {unit}<extra></extra>"))
    for x, text, color in ((limit, "limit", "#e63946"), (peak, "measured", "#264653")):
        if x:
            fig.add_vline(x=x / div, line={"color": color, "dash": "dash", "width": 1.5},
                          annotation_text=text, annotation_position="top",
                          annotation_font_color=color)
    return _layout(fig, "Best config: predicted memory by component", barmode="stack",
                   xaxis_title=unit, yaxis_visible=False, xaxis_rangemode="tozero",
                   legend={"orientation": "h", "y": -0.3, "traceorder": "normal"})


def knob_effects(trials: Sequence[Record]) -> go.Figure | None:
    """Best samples/s for each value of each knob: which choices pay, which do not."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    ran = [t for t in trials if t.outcome.ran]
    if not any(t.throughput for t in ran):
        return None
    grid = grid_knobs(ran)
    rows = math.ceil(len(grid) / 3)
    fig = make_subplots(rows=rows, cols=3, subplot_titles=[title for _, title in grid],
                        vertical_spacing=0.4 / rows, horizontal_spacing=0.07)
    for i, (attr, _) in enumerate(grid):
        values = sorted({getattr(t.config, attr) for t in ran}, key=_sort_key)
        best = [max((t.throughput or 0.0 for t in ran if getattr(t.config, attr) == v),
                    default=0.0) for v in values]
        counts = [_ok_count(ran, attr, v) for v in values]
        fig.add_trace(go.Bar(
            x=[_knob_text(v) for v in values], y=best, text=counts, textposition="outside",
            cliponaxis=False, marker_color="#2a9d8f", showlegend=False,
            hovertemplate="%{x}: best %{y:,.1f} samples/s<br>%{text}<extra></extra>"),
            row=i // 3 + 1, col=i % 3 + 1)
    top = max((t.throughput or 0.0 for t in ran), default=0.0)
    fig.update_xaxes(type="category")
    fig.update_yaxes(range=[0, 1.18 * top])  # room for the "n/m ok" labels above the bars
    fig.update_yaxes(title_text="best samples/s", col=1)
    fig.update_annotations(font_size=13)
    return _layout(fig, "Effect of each knob", height=80 + 220 * rows,
                   margin={"l": 60, "r": 20, "t": 70, "b": 40})


def _sort_key(v: Any) -> tuple[int, Any]:
    return (0, v) if isinstance(v, int | float) else (1, str(v))


def _knob_text(v: Any) -> str:
    return ("on" if v else "off") if isinstance(v, bool) else str(v)


def _ok_count(trials: Sequence[Record], attr: str, value: Any) -> str:
    same = [t for t in trials if getattr(t.config, attr) == value]
    return f"{sum(t.outcome.ok for t in same)}/{len(same)} ok"


def search_progress(trials: Sequence[Record]) -> go.Figure | None:
    """Best-so-far by trial and by time spent: did the search converge, or stop early?"""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    ran = sorted((t for t in trials if t.outcome.ran), key=lambda t: t.number or 0)
    if not any(t.throughput for t in ran):
        return None
    best, elapsed, so_far, clock = [], [], 0.0, 0.0
    for t in ran:
        so_far = max(so_far, t.throughput or 0.0)
        clock += known(t.outcome.wall_seconds) or 0.0
        best.append(so_far)
        elapsed.append(clock)
    fig = make_subplots(rows=1, cols=2, subplot_titles=["by trial number",
                                                        "by cumulative trial seconds"])
    numbers = [t.number for t in ran]
    for col, xs in ((1, numbers), (2, elapsed)):
        fig.add_trace(go.Scatter(
            x=xs, y=best, mode="lines", line={"shape": "hv", "color": "#264653"},
            name="best so far", showlegend=col == 1,
            hovertemplate="best so far %{y:,.1f} samples/s<extra></extra>"), row=1, col=col)
        fig.add_trace(go.Scatter(
            x=xs, y=[t.throughput or 0 for t in ran], mode="markers", name="trial",
            showlegend=col == 1, hovertext=[f"#{t.number} {t.config.label()}<br>"
                                            f"{t.outcome.status}" for t in ran],
            marker={"color": [STATUS_COLORS.get(t.outcome.status, "#888") for t in ran],
                    "size": 8}), row=1, col=col)
    fig.update_xaxes(title_text="trial", col=1)
    fig.update_xaxes(title_text="seconds", col=2)
    fig.update_yaxes(title_text="samples/s", col=1, rangemode="tozero")
    fig.update_yaxes(rangemode="tozero", col=2)
    fig.update_annotations(font_size=13)
    return _layout(fig, "Search progress", margin={"l": 60, "r": 20, "t": 70, "b": 48})


@dataclass(frozen=True)
class Panel:
    """One plot of the report: its div id, a sentence saying how to read it, and whether
    it spans both columns of the grid."""

    div_id: str
    caption: str
    build: Callable[[Sequence[Record], Summary], go.Figure | None]
    wide: bool = False


PANELS: tuple[Panel, ...] = (
    Panel("plot-throughput", "Every trial by peak memory and samples/s. Failed trials sit at "
          "0; pruned ones (never run) at their predicted memory. The dotted line is the "
          "Pareto front.",
          lambda ts, s: throughput_vs_memory(ts, known(s.memory_limit_bytes), {
              "best": s.best.number if s.best else None,
              "baseline": s.baseline.number if s.baseline else None})),
    Panel("plot-progress", "Best samples/s found so far, by trial and by time spent running "
          "trials.", lambda ts, s: search_progress(ts)),
    Panel("plot-knobs", "Best samples/s reached with each value of each knob; labels give "
          "how many trials with that value succeeded.", lambda ts, s: knob_effects(ts),
          wide=True),
    Panel("plot-predicted", "The memory model's prediction against the measured peak; points "
          "above the dashed line were underestimated.", lambda ts, s: predicted_vs_measured(ts)),
    Panel("plot-components", "The winner's predicted memory by component, with the "
          "measured peak and the limit.",
          lambda ts, s: memory_components(s)),
)


def figures(trials: Sequence[Record], summary: Summary) -> list[tuple[Panel, go.Figure]]:
    """The panels this summary has data for, in report order."""
    built = [(p, p.build(trials, summary)) for p in PANELS]
    return [(p, fig) for p, fig in built if fig is not None]
