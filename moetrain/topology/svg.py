"""Draw a rank map as SVG: one row per node, one cell per GPU, coloured by pipeline stage.

TP groups are outlined in black where their members sit side by side on a node; EP groups are
outlined with a dashed line in a colour of their own; thin lines separate NVSwitch domains,
thick lines rail groups. Readable at 64 nodes × 8 GPUs (cells of 78 × 34 px).
"""

from __future__ import annotations

import colorsys
from html import escape

from moetrain.topology.mapper import RankMap

__all__ = ["render_svg"]

_STAGE_COLOURS = ["#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5",
                  "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f"]


def _stage_colour(p: int, pp: int) -> str:
    if pp <= len(_STAGE_COLOURS):
        return _STAGE_COLOURS[p]
    r, g, b = colorsys.hls_to_rgb((p / pp) * 0.9, 0.78, 0.55)
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"


def _group_colour(i: int) -> str:
    r, g, b = colorsys.hls_to_rgb((i * 0.618034) % 1.0, 0.35, 0.85)
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"


def _runs(locals_: list[int]) -> list[tuple[int, int]]:
    """Contiguous runs [a, b] of sorted local indices."""
    out: list[tuple[int, int]] = []
    for x in sorted(locals_):
        if out and x == out[-1][1] + 1:
            out[-1] = (out[-1][0], x)
        else:
            out.append((x, x))
    return out


def render_svg(rm: RankMap, title: str = "") -> str:
    """The rank map as an SVG document (a string)."""
    tpn = rm.tasks_per_node
    n_nodes = len(rm.allocation)
    cw, ch = 78, 34
    left, top = 150, 70
    legend_h = 60
    width = left + tpn * cw + 20
    height = top + n_nodes * ch + legend_h + 20
    s = rm.sizes
    out: list[str] = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Arial, sans-serif">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    head = title or "rank map"
    out.append(f'<text x="10" y="20" font-size="14" font-weight="bold">{escape(head)}</text>')
    sub = (f"pp={s['pp']} dp={s['dp']} cp={s['cp']} tp={s['tp']} ep={s['ep']} · {rm.world} ranks on {n_nodes} nodes "
           f"({rm.profile.name}) · {len(rm.broken_rules)} broken rule(s)")
    out.append(f'<text x="10" y="38" font-size="11">{escape(sub)}</text>')
    for g in range(tpn):
        out.append(f'<text x="{left + g * cw + cw / 2}" y="{top - 8}" font-size="10" text-anchor="middle">GPU {g}</text>')

    pp_of, dp_of, cp_of, tp_of, ep_of = (rm.coord_array(a) for a in ("pp", "dp", "cp", "tp", "ep"))
    nodes = rm.allocation.nodes
    # cells
    for n in range(n_nodes):
        y = top + n * ch
        label = f"{nodes[n].name}  d{nodes[n].domain} g{nodes[n].rail_group}"
        out.append(f'<text x="{left - 6}" y="{y + ch / 2 + 4}" font-size="10" text-anchor="end">{escape(label)}</text>')
        for g in range(tpn):
            r = n * tpn + g
            x = left + g * cw
            p = int(pp_of[r])
            out.append(f'<rect x="{x}" y="{y}" width="{cw}" height="{ch}" fill="{_stage_colour(p, s["pp"])}" '
                       f'stroke="#999" stroke-width="0.5"><title>rank {r}: pp {p} dp {dp_of[r]} cp {cp_of[r]} '
                       f'tp {tp_of[r]} ep {ep_of[r]}</title></rect>')
            line2 = f"p{p} d{dp_of[r]}" + (f" c{cp_of[r]}" if s["cp"] > 1 else "") + f" t{tp_of[r]}"
            out.append(f'<text x="{x + cw / 2}" y="{y + 14}" font-size="11" text-anchor="middle">r{r}</text>')
            out.append(f'<text x="{x + cw / 2}" y="{y + 27}" font-size="9" text-anchor="middle">{escape(line2)}</text>')
    # domain and rail-group separators
    for n in range(1, n_nodes):
        y = top + n * ch
        if nodes[n].rail_group != nodes[n - 1].rail_group:
            out.append(f'<line x1="{left - 140}" y1="{y}" x2="{left + tpn * cw}" y2="{y}" stroke="black" stroke-width="3"/>')
        elif nodes[n].domain != nodes[n - 1].domain and rm.profile.domain_nodes > 1:
            out.append(f'<line x1="{left - 40}" y1="{y}" x2="{left + tpn * cw}" y2="{y}" stroke="#333" '
                       f'stroke-width="1.5" stroke-dasharray="2,2"/>')

    def outline(axis: str, inset: float, style: str, colour_of) -> None:
        arr = rm.group_array(axis)
        if arr.shape[1] <= 1:
            return
        for i, members in enumerate(arr.tolist()):
            by_node: dict[int, list[int]] = {}
            for r in members:
                by_node.setdefault(r // tpn, []).append(r % tpn)
            for n, loc in by_node.items():
                for a, b in _runs(loc):
                    x = left + a * cw + inset
                    y = top + n * ch + inset
                    w = (b - a + 1) * cw - 2 * inset
                    h = ch - 2 * inset
                    out.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="none" stroke="{colour_of(i)}" '
                               f'{style}/>')

    outline("tp", 1.5, 'stroke-width="2.5"', lambda i: "black")
    if s["ep"] > 1:
        outline("ep", 4.5, 'stroke-width="1.6" stroke-dasharray="5,3"', _group_colour)
    # legend
    y = top + n_nodes * ch + 22
    x = 10
    for p in range(min(s["pp"], 16)):
        out.append(f'<rect x="{x}" y="{y - 10}" width="14" height="12" fill="{_stage_colour(p, s["pp"])}" stroke="#999"/>')
        out.append(f'<text x="{x + 18}" y="{y}" font-size="10">stage {p}</text>')
        x += 70
        if x > width - 80:
            x, y = 10, y + 16
    y += 20
    out.append(f'<rect x="10" y="{y - 10}" width="30" height="12" fill="none" stroke="black" stroke-width="2.5"/>'
               f'<text x="46" y="{y}" font-size="10">TP group</text>')
    out.append(f'<rect x="120" y="{y - 10}" width="30" height="12" fill="none" stroke="{_group_colour(0)}" '
               f'stroke-width="1.6" stroke-dasharray="5,3"/><text x="156" y="{y}" font-size="10">EP group</text>')
    out.append(f'<line x1="230" y1="{y - 4}" x2="260" y2="{y - 4}" stroke="black" stroke-width="3"/>'
               f'<text x="266" y="{y}" font-size="10">rail group boundary</text>')
    out.append(f'<text x="390" y="{y}" font-size="10">cell: rank, p=stage d=dp t=tp</text>')
    out.append("</svg>")
    return "\n".join(out)
