"""The token strip: every token coloured by its exit depth, as HTML for st.html.

Each token is a <span data-testid="token" data-pos data-depth data-converged title=...>: test hooks
and a native tooltip, no JavaScript (st.html sanitises scripts away). Spaces, tabs and newlines are
drawn as visible marks (· → ↵) and newlines also break the line.

Colours: the sequential scale spans the depths present (`DepthScale`: shallowest light, deepest
dark), so a text whose tokens exit at 3, 4 and 5 gets three distinct colours, not three greens of a
1…r_max scale; the legend says which depths the scale spans and marks r_max.
"""
from __future__ import annotations

import hashlib
import html
from dataclasses import dataclass
from typing import Iterable, Sequence

from plotly.colors import sample_colorscale

SCALE = "Viridis"  # sequential and colour-blind safe; shallow = light yellow, deep = dark purple
NOT_CONVERGED = "#e8467c"  # outside the scale: tokens stopped by r_max, not by their rule
FONT = "ui-monospace, SFMono-Regular, Menlo, Consolas, monospace"


@dataclass(frozen=True)
class DepthScale:
    """The colour scale of a strip: depths lo..hi (those present) over the sequential scale; r_max
    is the cap, marked in the legend."""

    lo: int
    hi: int
    r_max: int

    @classmethod
    def of(cls, depths: Iterable[int], r_max: int) -> DepthScale:
        """The scale spanning `depths` (all depths when there are none)."""
        present = [int(d) for d in depths]
        return cls(min(present, default=1), max(present, default=r_max), r_max)

    def color(self, depth: int) -> str:
        """Hex colour of an exit depth (lo lightest, hi darkest; a single depth gets the middle)."""
        frac = 0.5 if self.hi <= self.lo else (depth - self.lo) / (self.hi - self.lo)
        rgb = sample_colorscale(SCALE, [1.0 - min(max(frac, 0.0), 1.0)], colortype="tuple")[0]
        return "#" + "".join(f"{round(255 * c):02x}" for c in rgb)


def text_color(background: str) -> str:
    r, g, b = (int(background[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return "#111" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.45 else "#fff"


def visible(piece: str) -> str:
    """Escaped token text with whitespace made visible (the marks are dimmed)."""
    if piece == "":
        return '<span style="opacity:.55">◌</span>'
    out = []
    for ch in piece:
        if ch == " ":
            out.append('<span style="opacity:.55">·</span>')
        elif ch == "\t":
            out.append('<span style="opacity:.55">→</span>')
        elif ch == "\n":
            out.append('<span style="opacity:.55">↵</span>')
        elif ch == "\r":
            continue
        else:
            out.append(html.escape(ch))
    return "".join(out)


def plain_visible(piece: str) -> str:
    """Token text with visible whitespace, as plain text (for chart labels and tables)."""
    if piece == "":
        return "◌"
    return piece.replace(" ", "·").replace("\t", "→").replace("\r", "").replace("\n", "↵")


@dataclass
class TokenView:
    piece: str
    depth: int
    converged: bool
    tooltip: str
    coloured: bool = True  # False: no depth to show (the first token, when tokens show the loops that produced them)
    regime: str = ""  # set: the token is coloured by its regime (REGIME_COLOURS), not by its depth


UNCOLOURED = "#eeeeee"
# a token's regime (recur_core.analysis.dynamics.REGIMES): blue, yellow, red (apart under colour blindness)
REGIME_COLOURS = {"settling": "#4c78a8", "marginal": "#f2cf5b", "drifting": "#e45756"}


def tooltip(pos: int, piece: str, depth: int, converged: bool, r_max: int, kl: float | None = None,
            prediction: str | None = None, prob: float | None = None, loss: float | None = None,
            policy: str = "", note: str | None = None, producer: str | None = None) -> str:
    """The strip's native tooltip; note: an extra line (e.g. a token's ground-truth hop count);
    producer: the token before, when the depth shown is the one spent there predicting this token
    (then prediction and loss are that position's too)."""
    loops = f"{depth} loop{'s' if depth != 1 else ''}"
    lines = [f"#{pos}  {plain_visible(piece)!r}",
             (f"exit depth: {loops}" if producer is None else
              f"produced at #{pos - 1} {plain_visible(producer)!r}, which exited at {loops}") +
             ("" if converged else f" (never converged: stopped at r_max = {r_max})")]
    if policy:
        lines.append(f"policy: {policy}")
    if kl is not None:
        lines.append(f"KL(p_i ‖ p_i−1) at exit: {kl:.2e} nats")
    if prediction is not None:
        lines.append(f"top prediction: {plain_visible(prediction)!r}" + (f" (p = {prob:.2f})" if prob is not None else ""))
    if loss is not None:
        lines.append(f"next-token loss at exit: {loss:.3f} nats")
    if note:
        lines.append(note)
    return "\n".join(lines)


def ids_key(ids: Sequence[int]) -> str:
    """A short fingerprint of the token ids a strip shows (its data-ids attribute, a test hook)."""
    return hashlib.sha1(",".join(str(int(i)) for i in ids).encode()).hexdigest()[:12]


def strip_html(tokens: Sequence[TokenView], scale: DepthScale, policy: str = "A1", selected: int | None = None,
               ids: Sequence[int] = ()) -> str:
    spans = []
    for pos, t in enumerate(tokens):
        bg = (REGIME_COLOURS[t.regime] if t.regime else UNCOLOURED if not t.coloured else
              scale.color(t.depth) if t.converged else NOT_CONVERGED)
        border = "2px dashed #7a0030" if not (t.converged or t.regime) else "1px solid rgba(0,0,0,.08)"
        if pos == selected:
            border = "2px solid #ff7f0e"
        style = (f"background:{bg};color:{text_color(bg)};border:{border};border-radius:4px;"
                 "padding:1px 3px;margin:1px 1px;display:inline-block;white-space:pre;cursor:help")
        spans.append(f'<span data-testid="token" data-pos="{pos}" data-depth="{int(t.depth)}" '
                     f'data-converged="{str(bool(t.converged)).lower()}" data-regime="{t.regime}" title="{html.escape(t.tooltip, quote=True)}" '
                     f'style="{style}">{visible(t.piece)}</span>')
        if "\n" in t.piece:
            spans.append("<br>")
    return (f'<div data-testid="token-strip" data-policy="{html.escape(policy)}" data-n-tokens="{len(tokens)}" data-ids="{ids_key(ids)}" '
            f'style="font-family:{FONT};font-size:0.92rem;line-height:1.9">{"".join(spans)}</div>')


def regime_legend_html(band: tuple[float, float], rate_loops: int) -> str:
    """The legend of a strip coloured by regime: each regime's colour and its contraction-rate range."""
    low, high = band
    ranges = {"settling": f"ρ < {low:g}", "marginal": f"{low:g} ≤ ρ ≤ {high:g}", "drifting": f"ρ > {high:g}"}
    cells = "".join(f'<span style="display:inline-block;background:{c};color:{text_color(c)};border-radius:4px;'
                    f'font-size:0.72rem;padding:0 6px;margin-left:6px">{name} ({ranges[name]})</span>'
                    for name, c in REGIME_COLOURS.items())
    return (f'<div data-testid="regime-legend" style="font-family:sans-serif;font-size:0.8rem;margin:2px 0 6px 0">'
            f'<span style="opacity:.8">regime: the contraction rate ρ of the step sizes ‖s_i − s_{{i−1}}‖ over the '
            f'last {rate_loops} loops of the uniform run:</span>{cells}</div>')


def legend_html(scale: DepthScale, label: str = "exit depth (loops)", not_converged: bool = True) -> str:
    """The depth scale: one cell per depth the colours span, then r_max; not_converged adds the mark
    of tokens the cap stopped (analysis strips)."""
    step = 1 if scale.hi - scale.lo < 16 else 4
    cells = []
    for d in range(scale.lo, scale.hi + 1):
        bg = scale.color(d)
        mark = str(d) if (d - scale.lo) % step == 0 or d == scale.hi else ""
        cells.append(f'<span title="{d} loop{"s" if d > 1 else ""}" style="display:inline-block;min-width:1.35em;'
                     f'text-align:center;background:{bg};color:{text_color(bg)};font-size:0.72rem;'
                     f'padding:1px 0">{mark or "&nbsp;"}</span>')
    span = (f"colours span {scale.lo}–{scale.hi}, the depths present" if scale.hi > scale.lo else
            f"every token at {scale.lo}")
    cap = (f'<span data-testid="legend-r-max" style="display:inline-block;border:1px solid #999;border-radius:4px;'
           f'font-size:0.72rem;padding:0 5px;margin-left:6px">r_max = {scale.r_max}</span>')
    never = (f'<span style="display:inline-block;background:{NOT_CONVERGED};color:#fff;border:2px dashed #7a0030;'
             f'border-radius:4px;font-size:0.72rem;padding:0 6px;margin-left:10px">not converged by r_max = '
             f'{scale.r_max}</span>') if not_converged else ""
    return (f'<div data-testid="depth-legend" data-lo="{scale.lo}" data-hi="{scale.hi}" data-r-max="{scale.r_max}" '
            f'style="font-family:sans-serif;font-size:0.8rem;margin:2px 0 6px 0">'
            f'<span style="margin-right:8px;opacity:.8">{html.escape(label)} ({span}):</span>'
            f'<span style="border-radius:4px;overflow:hidden;display:inline-block">{"".join(cells)}</span>'
            f'{cap}{never}<span style="margin-left:10px;opacity:.7">· space  ↵ newline  → tab</span></div>')
