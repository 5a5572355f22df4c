"""The report page: one self-contained HTML file (Jinja2), opened from disk with no server and no
network: plotly.js is inlined once, images and audio are data URIs.

`render(doc, out_dir)` takes plain data (`jobs/report.py` gathers it): the dataset section (summary
rows, snapshot history with lineage, figures, quarantine/filter/duplicate reasons with examples),
decoded samples (text as its tokens, images as PNG, audio as a player with a spectrogram, each
with id, source and segments) and the runs (figures, their own PNGs, generations).
"""

from __future__ import annotations

import base64
from pathlib import Path

from jinja2 import Environment, select_autoescape

TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>TokenLoom report: {{ dataset.name }}</title>
<style>
body { font-family: system-ui, sans-serif; margin: 0 2rem 3rem; color: #222; max-width: 1200px; }
h1 { margin-top: 1.2rem; } h2 { border-bottom: 2px solid #ddd; padding-bottom: .2rem; margin-top: 2.2rem; }
table { border-collapse: collapse; margin: .5rem 0 1rem; font-size: .9rem; }
td, th { border: 1px solid #ddd; padding: .25rem .5rem; text-align: left; vertical-align: top; }
.grid { display: grid; grid-template-columns: repeat(auto-fit, minmax(520px, 1fr)); gap: 1rem; }
.sample { border: 1px solid #ddd; border-radius: 6px; padding: .6rem; margin: .6rem 0; }
.tok { background: #eef3fb; border: 1px solid #c9d7ef; border-radius: 3px; padding: 0 1px; margin: 1px;
       display: inline-block; white-space: pre-wrap; font-family: monospace; font-size: .85rem; }
.meta { color: #666; font-size: .85rem; } nav a { margin-right: 1rem; } .none { color: #888; font-style: italic; }
img.decoded { image-rendering: pixelated; width: 192px; border: 1px solid #ccc; }
img.spec { width: 360px; } img.plot { max-width: 100%; border: 1px solid #eee; }
</style>
<script>{{ plotlyjs|safe }}</script>
</head><body>
<h1>{{ dataset.name }} <span class="meta">snapshot {{ dataset.snapshot_id }}</span></h1>
<nav><a href="#dataset">dataset</a><a href="#samples">samples</a><a href="#runs">runs</a></nav>

<h2 id="dataset">Dataset</h2>
<table>{% for k, v in dataset.rows %}<tr><th>{{ k }}</th><td>{{ v }}</td></tr>{% endfor %}</table>
<div class="grid">{% for fig in dataset.figures %}<div class="plot">{{ fig|safe }}</div>{% endfor %}</div>
<h3>Snapshot history and lineage</h3>
<table><tr><th>snapshot</th><th>when (UTC)</th><th>operation</th><th>job</th><th>samples added</th>
<th>tokens added</th><th>quarantined</th><th>vocabulary</th><th>bundles</th><th>sources</th><th>tags</th></tr>
{% for s in dataset.history %}<tr><td>{{ s.snapshot_id }}</td><td>{{ s.when }}</td><td>{{ s.operation }}</td>
<td>{{ s.job_id }}</td><td>{{ s.samples }}</td><td>{{ s.tokens }}</td><td>{{ s.quarantined }}</td>
<td>{{ s.vocab_id }}</td><td>{{ s.bundles }}</td><td>{{ s.sources }}</td><td>{{ s.tags }}</td></tr>{% endfor %}</table>
{% for section in dataset.reasons %}<h3>{{ section.title }}</h3>
{% if section.rows %}<p class="meta">{{ section.counts.values()|sum }} over the lineage; the first {{ section.rows|length }} records:</p>{% endif %}
{% if section.rows %}<table><tr><th>reason</th><th>source</th></tr>
{% for r in section.rows %}<tr><td>{{ r.reason }}</td><td>{{ r.examples }}</td></tr>{% endfor %}
</table>{% else %}<p class="none">none</p>{% endif %}{% endfor %}
<h3>Ingestion pools</h3>
{% if dataset.pools %}<table><tr>{% for k in dataset.pools[0] %}<th>{{ k }}</th>{% endfor %}</tr>
{% for p in dataset.pools %}<tr>{% for v in p.values() %}<td>{{ v }}</td>{% endfor %}</tr>{% endfor %}</table>
{% else %}<p class="none">no per-pool figures recorded in this snapshot's summary</p>{% endif %}

<h2 id="samples">Samples</h2>
<p class="meta">{{ samples_note }}</p>
{% for mix, group in samples %}<h3>{{ mix }}</h3>{% for s in group %}<div class="sample">
<div class="meta">{{ s.sample_id }} &middot; {{ s.source }} &middot; segments: {{ s.segments }}</div>
{% for p in s.parts %}{% if p.kind == "text" %}<div>{% for t in p.tokens %}<span class="tok">{{ t }}</span>{% endfor %}</div>
{% elif p.kind == "image" %}<img class="decoded" alt="decoded image {{ p.grid }}" src="data:image/png;base64,{{ p.png }}">
{% elif p.kind == "audio" %}<div><audio controls preload="auto" src="data:audio/wav;base64,{{ p.wav }}"></audio>
<img class="spec" alt="spectrogram" src="data:image/png;base64,{{ p.spectrogram }}"></div>{% endif %}{% endfor %}
</div>{% endfor %}{% else %}<p class="none">no samples</p>{% endfor %}

<h2 id="runs">Runs</h2>
{% if runs.figures %}<div class="grid">{% for fig in runs.figures %}<div class="plot">{{ fig|safe }}</div>{% endfor %}</div>
{% else %}<p class="none">no runs given (--run NAME)</p>{% endif %}
{% for run in runs.list %}<h3>{{ run.name }}</h3>
<table>{% for k, v in run.rows %}<tr><th>{{ k }}</th><td>{{ v }}</td></tr>{% endfor %}</table>
{% for fig in run.figures %}<div class="plot">{{ fig|safe }}</div>{% endfor %}
{% for t in run.tiers %}<h4>{{ t.title }}</h4><table class="tiers"><tr>{% for c in t.columns %}<th>{{ c }}</th>{% endfor %}</tr>
{% for r in t.rows %}<tr>{% for v in r %}<td>{{ v }}</td>{% endfor %}</tr>{% endfor %}</table>{% endfor %}
{% for img in run.images %}<figure><img class="plot" alt="{{ img.title }}" src="data:image/png;base64,{{ img.png }}">
<figcaption class="meta">{{ img.title }}</figcaption></figure>{% endfor %}
{% for g in run.generations %}<div class="sample"><div class="meta">generated: {{ g.title }}</div>
{% if g.kind == "image" %}<img class="decoded" alt="{{ g.title }}" src="data:image/png;base64,{{ g.data }}">
{% elif g.kind == "audio" %}<audio controls preload="auto" src="data:audio/wav;base64,{{ g.data }}"></audio>
{% else %}<pre>{{ g.data }}</pre>{% endif %}</div>{% endfor %}
{% endfor %}
</body></html>
"""


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def render(doc: dict, out_dir: Path) -> Path:
    """Write `out_dir/index.html` from the gathered `doc`; returns its path."""
    from plotly.offline import get_plotlyjs

    env = Environment(autoescape=select_autoescape(default=True, default_for_string=True))
    html = env.from_string(TEMPLATE).render(plotlyjs=get_plotlyjs(), **doc)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "index.html"
    path.write_text(html, encoding="utf-8")
    return path
