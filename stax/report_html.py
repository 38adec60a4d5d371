"""The report's page: HTML and SVG for an `Explanation` (report.py), self-contained.

Layer: top, under ``report`` (which builds the Explanation it draws). Imports no stax module: it
reads the Explanation's plain fields (functions -> artifacts -> kernels, roofs).

Consumes: an Explanation. Produces: one HTML page (inline CSS, one small inline script for the
hover highlighting, SVG pictures drawn by Stax's own layout: no network, works opened from disk),
or the body alone for Jupyter.

Where to look: ``fusion_svg`` (kernels in columns by dependence depth, an edge per buffer),
``roofline_svg`` (log-log, the measured roofs), ``_kernel_html`` (each source line tagged with
the graph node it computes), ``page``.
"""
from __future__ import annotations

import html
import math


def _esc(x) -> str:
    return html.escape(str(x), quote=True)


def _layers(kernels: list) -> list:
    """Column of each kernel: one more than the deepest kernel that writes a buffer it reads."""
    writer, column = {}, []
    for i, k in enumerate(kernels):
        column.append(1 + max((column[writer[b]] for b in k.reads if b in writer), default=0))
        for b in k.writes:
            writer[b] = i
    return column


def fusion_svg(art: ArtifactInfo, graph_inputs: list) -> str:
    """The fusion graph: graph inputs on the left, one box per kernel (its kind, section and the
    graph nodes it fuses), columns by dependence depth, an edge per buffer between kernels."""
    ks = art.kernels
    col = _layers(ks)
    w, row_h, gap = 250, 18, 30
    heights = [34 + row_h * max(1, len(k.nodes)) for k in ks]
    pos, next_y = {}, {}
    for i, c in enumerate(col):
        y = next_y.get(c, 20)
        pos[i] = (20 + c * (w + 80), y)
        next_y[c] = y + heights[i] + gap
    in_pos = {name: (20, 20 + j * 40) for j, name in enumerate(graph_inputs)}
    width = 20 + (max(col, default=0) + 1) * (w + 80) + 20
    height = max([y for y in next_y.values()] + [20 + 40 * len(graph_inputs), 80]) + 20
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="fusion" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}">',
             '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" '
             'markerHeight="6" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>']
    writer = {}
    for i, k in enumerate(ks):
        for b in k.reads:
            if b in writer:
                (x0, y0), j = pos[writer[b]], writer[b]
                x1, y1 = pos[i]
                parts.append(_edge(x0 + w, y0 + heights[j] / 2, x1, y1 + heights[i] / 2, b))
            elif b in in_pos:
                x0, y0 = in_pos[b]
                x1, y1 = pos[i]
                parts.append(_edge(x0 + 90, y0 + 12, x1, y1 + heights[i] / 2, b))
        for b in k.writes:
            writer[b] = i
    for name, (x, y) in in_pos.items():
        parts.append(f'<g class="input"><rect x="{x}" y="{y}" width="90" height="24" rx="4"/>'
                     f'<text x="{x + 45}" y="{y + 16}" text-anchor="middle">{_esc(name)}</text></g>')
    for i, k in enumerate(ks):
        x, y = pos[i]
        cls = "fallback" if k.kind == "fallback" else "reduction" if "reduction" in k.kind else \
            "template" if k.kind == "template" else "pointwise"
        parts.append(f'<g class="kernel {cls}" data-kernel="{_esc(k.name)}">'
                     f'<rect x="{x}" y="{y}" width="{w}" height="{heights[i]}" rx="6"/>'
                     f'<text x="{x + 8}" y="{y + 15}" class="kname">{_esc(k.name)}</text>'
                     f'<text x="{x + 8}" y="{y + 29}" class="kkind">{_esc(k.kind)} ({_esc(k.section)})</text>')
        for j, node in enumerate(k.nodes or ["(no graph node)"]):
            parts.append(f'<text x="{x + 16}" y="{y + 46 + j * row_h}" class="node" '
                         f'data-node="{_esc(node)}">{_esc(node)}</text>')
        parts.append("</g>")
    parts.append("</svg>")
    return "\n".join(parts)


def _edge(x0, y0, x1, y1, label) -> str:
    mx = (x0 + x1) / 2
    return (f'<g class="edge"><path d="M{x0:.0f},{y0:.0f} C{mx:.0f},{y0:.0f} {mx:.0f},{y1:.0f} '
            f'{x1:.0f},{y1:.0f}" marker-end="url(#arrow)"/><text x="{mx:.0f}" y="{(y0 + y1) / 2 - 4:.0f}" '
            f'text-anchor="middle">{_esc(label)}</text></g>')


def roofline_svg(points: list, roofs) -> str:
    """Log-log roofline: x = ops per byte, y = ops per second; one circle per timed kernel."""
    W, H, L, B = 560, 340, 70, 40
    xs = [p["intensity"] for p in points] + [roofs.compute / roofs.bandwidth]
    lo_x, hi_x = 10 ** math.floor(math.log10(max(min(xs), 1e-3) / 10)), 10 ** math.ceil(math.log10(max(xs) * 10))
    ys = [p["throughput"] for p in points if p["throughput"] > 0] + [roofs.compute]
    lo_y, hi_y = 10 ** math.floor(math.log10(max(min(ys), 1.0) / 10)), 10 ** math.ceil(math.log10(max(ys) * 2))

    def X(v):
        return L + (math.log10(v) - math.log10(lo_x)) / (math.log10(hi_x) - math.log10(lo_x)) * (W - L - 20)

    def Y(v):
        return H - B - (math.log10(v) - math.log10(lo_y)) / (math.log10(hi_y) - math.log10(lo_y)) * (H - B - 20)

    ridge = roofs.compute / roofs.bandwidth
    roof = [(lo_x, max(lo_x * roofs.bandwidth, lo_y)), (ridge, roofs.compute), (hi_x, roofs.compute)]
    path = " L".join(f"{X(x):.1f},{Y(min(max(y, lo_y), hi_y)):.1f}" for x, y in roof)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="roofline" width="{W}" height="{H}" viewBox="0 0 {W} {H}">',
             f'<rect x="{L}" y="20" width="{W - L - 20}" height="{H - B - 20}" class="frame"/>',
             f'<path d="M{path}" class="roof"/>',
             f'<text x="{L + 6}" y="34" class="axis">memory roof {roofs.bandwidth / 1e9:.1f} GB/s, '
             f'compute roof {roofs.compute / 1e9:.1f} Gop/s</text>',
             f'<text x="{(W + L) / 2}" y="{H - 8}" text-anchor="middle" class="axis">arithmetic intensity (ops/byte)</text>',
             f'<text x="14" y="{H / 2}" transform="rotate(-90 14 {H / 2})" text-anchor="middle" class="axis">ops/s</text>']
    for decade in range(int(math.log10(lo_x)), int(math.log10(hi_x)) + 1):
        parts.append(f'<text x="{X(10 ** decade):.0f}" y="{H - B + 14}" text-anchor="middle" class="tick">1e{decade}</text>')
    for decade in range(int(math.log10(lo_y)), int(math.log10(hi_y)) + 1, 2):
        parts.append(f'<text x="{L - 4}" y="{Y(10 ** decade):.0f}" text-anchor="end" class="tick">1e{decade}</text>')
    for p in points:
        parts.append(f'<circle cx="{X(p["intensity"]):.1f}" cy="{Y(max(p["throughput"], lo_y)):.1f}" r="5" '
                     f'class="point" data-kernel="{_esc(p["kernel"])}"><title>{_esc(p["kernel"])}: '
                     f'{p["intensity"]:.3g} ops/B, {p["throughput"] / 1e9:.3g} Gop/s</title></circle>')
    parts.append("</svg>")
    return "\n".join(parts)


# ---- The page ----

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px; color: #222; max-width: 1400px; }
h1 { font-size: 22px; } h2 { font-size: 18px; border-bottom: 1px solid #ccc; } h3 { font-size: 15px; }
pre { background: #f6f6f4; padding: 8px; overflow-x: auto; font: 12px/1.35 ui-monospace, monospace; }
pre.code span.ln { display: block; } pre.code span.ln[data-node]:hover, .hl { background: #ffe58a; }
.cols { display: flex; gap: 16px; flex-wrap: wrap; } .cols > div { flex: 1 1 520px; min-width: 0; }
table { border-collapse: collapse; } td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; }
svg text { font: 11px ui-monospace, monospace; } svg .kname { font-weight: bold; }
svg .kernel rect { fill: #eef4ff; stroke: #4a72c4; } svg .reduction rect { fill: #eefaf0; stroke: #3c9a52; }
svg .fallback rect { fill: #f3f3f3; stroke: #888; stroke-dasharray: 4 3; }
svg .template rect { fill: #fff3e6; stroke: #d08a2c; } svg .input rect { fill: #fff; stroke: #999; }
svg .edge path { fill: none; stroke: #777; } svg .edge text { fill: #555; }
svg .node.hl { fill: #b00; font-weight: bold; } svg .frame { fill: none; stroke: #ccc; }
svg .roof { fill: none; stroke: #c33; stroke-width: 2; } svg .point { fill: #4a72c4; opacity: .8; }
.note { color: #666; font-size: 12px; }
"""

# Hovering a line (or a node in the picture) highlights every line and box of that graph node.
SCRIPT = """
document.addEventListener('mouseover', function (e) {
  var t = e.target.closest('[data-node]');
  document.querySelectorAll('.hl').forEach(function (x) { x.classList.remove('hl'); });
  if (!t) return;
  var scope = t.closest('section.artifact') || document;
  scope.querySelectorAll('[data-node="' + CSS.escape(t.dataset.node) + '"]')
       .forEach(function (x) { x.classList.add('hl'); });
});
"""


def _pre(text: str) -> str:
    return f"<pre>{_esc(text.rstrip()) or '(empty)'}</pre>"


def _kernel_html(k) -> str:
    if not k.source:
        return f"<h4>{_esc(k.name)}</h4><p class='note'>a fallback call ({_esc(k.section)}): no generated source</p>"
    lines = []
    for ln, node in zip(k.source.splitlines(), list(k.origins) + [None] * len(k.source.splitlines())):
        attr = f' data-node="{_esc(node)}" title="graph node {_esc(node)}"' if node else ""
        lines.append(f'<span class="ln"{attr}>{_esc(ln) or " "}</span>')
    tuning = ""
    if k.tuning:
        rows = "".join(f"<tr><td>{_esc(c)}</td><td>{t:.4f}</td></tr>" for c, t in
                       zip(k.tuning.get("candidates", []), k.tuning.get("candidate_ms", [])))
        tuning = (f"<p>autotuning: chose <code>{_esc(k.tuning.get('config'))}</code> "
                  f"({k.tuning.get('ms', 0):.4f} ms)</p><table><tr><th>candidate</th><th>ms</th></tr>{rows}</table>")
    return (f'<h4 id="k-{_esc(k.name)}">{_esc(k.name)}: {_esc(k.kind)} ({_esc(k.section)}), '
            f'fuses {_esc(", ".join(k.nodes))}</h4><pre class="code">{"".join(lines)}</pre>{tuning}')


def _traffic_table(a) -> str:
    rows = "".join(
        f"<tr><td>{_esc(k.name)}</td><td>{_esc(k.kind)}</td><td>{k.nbytes:,}</td><td>{k.ops:,}</td>"
        f"<td>{'' if k.seconds is None else f'{k.seconds * 1e6:.1f}'}</td></tr>" for k in a.kernels)
    ratio = a.moved / a.bound if a.bound else float("nan")
    return (f"<table><tr><th>kernel</th><th>kind</th><th>bytes moved</th><th>ops (estimate)</th>"
            f"<th>µs (median)</th></tr>{rows}</table><p>bytes moved {a.moved:,} B; lower bound (Prop. 1.1: "
            f"inputs read once, outputs written once) {a.bound:,} B; ratio {ratio:.2f}</p>")


def _graph_inputs(a) -> list:
    written = {b for k in a.kernels for b in k.writes}
    return list(dict.fromkeys(b for k in a.kernels for b in k.reads if b not in written))


def _artifact_html(f, a) -> str:
    guards = "".join(_pre(g) for g in a.guards) or "<p class='note'>none recorded</p>"
    recompiles = "".join(f"<li>{_esc(r)}</li>" for r in a.recompiles)
    return (f'<section class="artifact"><h3>{_esc(f.name)}: {_esc(a.title)} ({len(a.kernels)} kernel(s))</h3>'
            f"<h4>Fusion graph</h4><p class='note'>drawn by Stax's own layout: kernels in columns by "
            f"dependence depth, an arrow per buffer passed between kernels</p>{fusion_svg(a, _graph_inputs(a))}"
            f"{_traffic_table(a)}"
            f"<h4>Guards</h4>{guards}"
            + (f"<h4>Why it was compiled again</h4><ul>{recompiles}</ul>" if recompiles else "")
            + (f"<h4>CUDA graphs (§9.9)</h4>{''.join(_pre(c) for c in a.cudagraphs)}" if a.cudagraphs else "")
            + f"<div class='cols'><div><h4>Captured graph</h4>{_pre(a.graph)}</div>"
            f"<div><h4>Loop-level IR</h4>{_pre(a.ir)}</div></div>"
            f"<h4>Schedule</h4>{_pre(a.schedule)}"
            f"<h4>Kernels</h4><p class='note'>hover a line to see every line of the same graph node</p>"
            + "".join(_kernel_html(k) for k in a.kernels)
            + f"<h4>Wrapper</h4>{_pre(a.wrapper)}</section>")


def page_body(expl) -> str:
    parts = []
    for f in expl.functions:
        s = f.stats
        parts.append(f"<h2>{_esc(f.name)} <span class='note'>{_esc(f.where)}</span></h2>"
                     f"<p>{s.get('calls', 0)} call(s), {s.get('compiles', 0)} compile(s) in "
                     f"{s.get('compile_seconds', 0):.2f} s, {s.get('eager_calls', 0)} eager call(s)</p>")
        parts.extend(_artifact_html(f, a) for a in f.artifacts)
    if expl.roofs is not None:
        pts = expl.roofline_points()
        parts.append(f"<h2>Roofline</h2><p class='note'>{_esc(expl.roofs.how)}. Each point is a kernel of "
                     "each function's last artifact: its estimated ops (one per printed arithmetic line, "
                     "times the iterations; 2mnk for a matmul) over its bytes (the table above), against its "
                     f"median time inside real calls. {len(pts)} kernel(s) plotted.</p>"
                     + roofline_svg(pts, expl.roofs))
    return "\n".join(parts)


def page(expl, title: str) -> str:
    return (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{_esc(title)}</title>"
            f"<style>{CSS}</style></head><body><h1>{_esc(title)}</h1>"
            f"<p class='note'>Generated by Stax on {_esc(expl.device)}. Self-contained: no network, no "
            f"external scripts. Pictures are SVG drawn by Stax's own layout.</p>{page_body(expl)}"
            f"<script>{SCRIPT}</script></body></html>\n")
