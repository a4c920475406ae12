"""`rollout show FILE --html OUT`: one self-contained page (inline CSS and JS, nothing fetched).

Every output token is a `span.tok` coloured by two things at once: its background by its
log-probability (green at 0, yellow at -3, red at -6 and below) and its underline by its support
width (pale = one token, deep blue = the widest support of the page), or the other way round with
the switch at the top. Tokens are grouped per verify step (`span.step`, a bar at each boundary); the step's last
token, the target's own sample (the correction of a rejected draft, or the bonus after a fully
accepted block), is outlined, the accepted drafts before it are not. Hovering a token shows its
id, log-prob, probability, width, step and the most likely other tokens of its support. The
colours are set by the page's script from each span's data attributes.
"""

from __future__ import annotations

import html
import json
import math

from rollout.show import SampleView, TokenView

_CSS = """
body { font: 14px/1.5 system-ui, sans-serif; margin: 1.5em; color: #222; background: #fff; }
h1 { font-size: 1.2em; } h2 { font-size: 1em; margin: 1.2em 0 0.2em; }
.facts { color: #555; margin: 0.2em 0; font-size: 0.9em; }
.prompt { color: #666; white-space: pre-wrap; font-family: ui-monospace, monospace; margin: 0.3em 0; }
.output { font-family: ui-monospace, monospace; white-space: pre-wrap; line-height: 1.9; }
.step { border-left: 2px solid #333; padding-left: 1px; margin-left: 1px; }
.tok { padding: 1px 0; border-bottom: 3px solid transparent; }
.tok.target { outline: 1px solid #222; outline-offset: -1px; }
.tok.partial { color: #999; }
.controls, .legend { margin: 0.4em 0; font-size: 0.9em; }
.swatch { display: inline-block; padding: 0 0.5em; margin-right: 2px; white-space: nowrap; }
"""

_SCRIPT = """
(function () {
  const toks = Array.from(document.querySelectorAll('span.tok'));
  const maxWidth = Math.max(1, ...toks.map(t => Number(t.dataset.w || 1)));
  // green at log-prob 0, yellow at -3, red at -6 and below
  function lpColour(lp) { return 'hsl(' + Math.round(120 * Math.max(0, 1 + lp / 6)) + ', 75%, 78%)'; }
  function widthColour(w) {
    if (!w) return 'hsl(0, 0%, 85%)';
    const depth = maxWidth > 1 ? Math.log(Number(w)) / Math.log(maxWidth) : 0;
    return 'hsl(215, 80%, ' + Math.round(92 - 50 * depth) + '%)';
  }
  function paint(mode) {
    for (const t of toks) {
      const byLp = lpColour(Number(t.dataset.lp)), byWidth = widthColour(t.dataset.w);
      t.style.backgroundColor = mode === 'width' ? byWidth : byLp;
      t.style.borderBottomColor = mode === 'width' ? byLp : byWidth;
    }
    const legend = document.getElementById('legend');
    legend.innerHTML = '';
    const scale = mode === 'width'
      ? [1, 2, 4, 16, maxWidth].filter((w, i, a) => w <= maxWidth && a.indexOf(w) === i).map(w => [w, widthColour(w)])
      : [0, -1, -2, -3, -4, -6].map(lp => [lp, lpColour(lp)]);
    legend.append(mode === 'width' ? 'background: support width ' : 'background: log-probability ');
    for (const [label, colour] of scale) {
      const s = document.createElement('span');
      s.className = 'swatch'; s.style.backgroundColor = colour; s.textContent = label;
      legend.append(s);
    }
    legend.append(mode === 'width' ? ' (underline: probability)' : ' (underline: support width)');
    document.body.dataset.mode = mode;
  }
  for (const input of document.querySelectorAll('input[name=mode]')) {
    input.addEventListener('change', () => paint(input.value));
  }
  paint('logprob');
})();
"""


def render_page(views: list[SampleView], title: str, total: int) -> str:
    """The page for `views` (the first of `total` samples of the file named `title`)."""
    more = f" (the first {len(views)} of {total})" if total > len(views) else ""
    body = "\n".join(_sample(i, v) for i, v in enumerate(views))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>rollout {html.escape(title)}</title>
<style>{_CSS}</style></head>
<body>
<h1>rollout {html.escape(title)}: {len(views)} samples{more}</h1>
<div class="controls">colour the background by
<label><input type="radio" name="mode" value="logprob" checked> log-probability</label>
<label><input type="radio" name="mode" value="width"> support width</label>
· a bar starts each verify step; the outlined token ends it (the target's own sample)</div>
<div class="legend" id="legend"></div>
{body}
<script>{_SCRIPT}</script>
</body></html>
"""


def _sample(index: int, view: SampleView) -> str:
    steps: list[list[TokenView]] = []
    for t in view.tokens:
        if not steps or steps[-1][-1].step != t.step:
            steps.append([])
        steps[-1].append(t)
    output = "".join(f'<span class="step" data-step="{s[0].step}">' + "".join(map(_token, s)) + "</span>"
                     for s in steps)
    return (f'<section class="sample" data-index="{index}">\n<h2>{html.escape(view.title)}</h2>\n'
            f'<p class="facts">{html.escape(" · ".join(view.facts))}</p>\n'
            f'<div class="prompt">{html.escape(view.prompt)}</div>\n<div class="output">{output}</div>\n</section>')


def _token(t: TokenView) -> str:
    kind = "target" if t.target else "draft"
    shown = t.piece.replace("\n", "↵\n") or "·"  # a newline stays visible; "": part of a character
    classes = f"tok {kind}" + (" partial" if not t.piece else "")
    others = ", ".join(json.dumps(p, ensure_ascii=False) + ("" if q is None else f" {q:.3f}")
                       for p, q in t.alternatives)
    tip = (f"id {t.token_id} · log-prob {t.logprob:.4f} (p {math.exp(t.logprob):.4f}) · width "
           f"{'-' if t.width is None else t.width} · step {t.step} ({kind})"
           + (f" · others: {others}" if others else ""))
    width = "" if t.width is None else f' data-w="{t.width}"'
    return (f'<span class="{classes}" data-lp="{t.logprob:.6g}"{width} title="{html.escape(tip)}">'
            f'{html.escape(shown)}</span>')
