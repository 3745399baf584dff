"""Result tables and plots: a Markdown table printed, CSV / Markdown / PNG written where asked.

Every result states the device, torch (and Triton) version and date. Nothing is written unless an
``out_dir`` is given: results never land in an installed tree by default.
"""

from __future__ import annotations

import csv
import datetime
import os
import platform
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["device_name", "env_header", "markdown_table", "write_results", "read_results", "plot_panels",
           "plot_lines", "plot_stacked_bars"]


def device_name(device: torch.device | str | None = None) -> str:
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU {cpu} ({os.cpu_count()} cores)"


def env_header(device: torch.device | str | None = None) -> str:
    """One line: device, torch, Triton (if importable), Python, UTC date, and the ``DYNAMO_ONCE_*`` switches set in
    the environment (``NAME=value``; not the API key), so that a figure says which paths it measured."""
    try:
        import triton

        tri = f", triton {triton.__version__}"
    except ImportError:
        tri = ""
    return (f"{device_name(device)}, torch {torch.__version__}{tri}, Python {platform.python_version()}, "
            f"{utc_now()}{switches()}")


def utc_now() -> str:
    """The UTC date and minute, as result headers give it."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def switches() -> str:
    """``", NAME=value"`` for each ``DYNAMO_ONCE_*`` variable set in the environment but the API key; "" if none."""
    return "".join(f", {k}={v}" for k, v in sorted(os.environ.items())
                   if k.startswith("DYNAMO_ONCE_") and k != "DYNAMO_ONCE_API_KEY")


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) and abs(v) < 1e-2 and v != 0 else str(v)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    columns = list(columns or (rows[0].keys() if rows else []))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def write_results(name: str, rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None, *,
                  title: str = "", notes: Sequence[str] = (), device: torch.device | str | None = None,
                  out_dir: str | None = None, header: str | None = None) -> str:
    """Print a Markdown table and, with ``out_dir``, save ``<name>.csv`` and ``<name>.md`` there;
    returns the Markdown.

    ``header`` replaces the environment line (for rows measured elsewhere and assembled here).
    """
    columns = list(columns or (rows[0].keys() if rows else []))
    header = header or env_header(device)
    md = "\n".join([f"# {title or name}", "", header, "", markdown_table(rows, columns), "",
                    *[f"- {n}" for n in notes]]) + "\n"
    print(md)
    if not out_dir:
        return md
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out_dir, f"{name}.csv"), "w", newline="") as f:
        f.write(f"# {header}\n")
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return md


def read_results(path: str) -> tuple[str, list[dict[str, Any]]]:
    """A CSV :func:`write_results` saved: its environment line and its rows, each cell a bool (``True`` /
    ``False``), an int, a float or, failing those, the text as written (an empty cell: ``""``)."""
    with open(path, newline="") as f:
        first = f.readline()
        header = first[2:].strip() if first.startswith("# ") else ""
        if not header:
            f.seek(0)  # no environment line: the first line is the columns'
        return header, [{k: _parse_cell(v) for k, v in r.items()} for r in csv.DictReader(f)]


def _parse_cell(text: str) -> Any:
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'dynamo-once[bench]')")
        return None
    return plt


def _pyplot_for(out_dir: str | None) -> Any:
    """pyplot, with ``out_dir`` created, where a plot is to be saved; None without ``out_dir`` or matplotlib."""
    if not out_dir:
        return None
    plt = _pyplot()
    if plt is not None:
        os.makedirs(out_dir, exist_ok=True)
    return plt


def _save(plt: Any, fig: Any, out_dir: str, name: str) -> str:
    """Write ``fig`` to ``<out_dir>/<name>.png``, close it, return the path."""
    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _draw(ax: Any, rows: Sequence[dict[str, Any]], x: str, y: str, series: str, logx: bool, logy: bool,
          hlines: dict[str, float] | None) -> None:
    """One line per value of ``series`` (rows without ``y`` skipped), dashed ``hlines``, log axes."""
    for s in dict.fromkeys(r[series] for r in rows):
        pts = [(r[x], r[y]) for r in rows if r[series] == s and r[y] not in ("", None)]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=str(s))
    for label, value in (hlines or {}).items():
        ax.axhline(value, linestyle="--", color="gray")
        ax.annotate(label, (0.01, value), xycoords=("axes fraction", "data"), fontsize=8, va="bottom")
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)


def plot_panels(name: str, rows: Sequence[dict[str, Any]], *, x: str, y: str, series: str, panel: str | None,
                title: str = "", xlabel: str = "", ylabel: str = "", logx: bool = False, logy: bool = False,
                hlines: dict[str, float] | None = None, out_dir: str | None = None) -> str | None:
    """Save ``<name>.png``: one subplot per value of ``panel`` (side by side, shared y; ``None``: one plot),
    each with ``y`` against ``x``, one line per value of ``series``. None without matplotlib or
    ``out_dir``."""
    plt = _pyplot_for(out_dir)
    if plt is None:
        return None
    panels = list(dict.fromkeys(r[panel] for r in rows)) if panel else [None]
    width = 5 * len(panels) if panel else 8
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 5 if panel is None else 4.5), sharey=True,
                             squeeze=False)
    for ax, p in zip(axes[0], panels):
        _draw(ax, [r for r in rows if panel is None or r[panel] == p], x, y, series, logx, logy, hlines)
        if panel is not None:
            ax.set_title(f"{panel} = {p}", fontsize=9)
        ax.set_xlabel(xlabel or x)
    axes[0][0].set_ylabel(ylabel or y)
    axes[0][-1].legend(fontsize=8 if panel is None else 7)
    if panel is None:
        axes[0][0].set_title(title or name, fontsize=10)
    else:
        fig.suptitle(title or name, fontsize=10)
    return _save(plt, fig, out_dir, name)


def plot_lines(name: str, rows: Sequence[dict[str, Any]], *, x: str, y: str, series: str, **kwargs: Any) -> str | None:
    """Save ``<name>.png``: ``y`` against ``x``, one line per value of ``series`` (one panel of :func:`plot_panels`)."""
    return plot_panels(name, rows, x=x, y=y, series=series, panel=None, **kwargs)


def plot_stacked_bars(name: str, rows: Sequence[dict[str, Any]], *, label: Sequence[str], parts: Sequence[str],
                      title: str = "", ylabel: str = "", out_dir: str | None = None) -> str | None:
    """Save ``<name>.png``: one bar per row (named by its ``label`` fields), stacked from its ``parts`` (the
    phases of a start-up, say). None without matplotlib or ``out_dir``."""
    plt = _pyplot_for(out_dir)
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(rows)), 5))
    names = ["\n".join(str(r[k]) for k in label) for r in rows]
    bottom = [0.0] * len(rows)
    for part in parts:
        values = [float(r[part] or 0) for r in rows]
        ax.bar(names, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel(ylabel)
    ax.set_title(title or name, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    return _save(plt, fig, out_dir, name)
