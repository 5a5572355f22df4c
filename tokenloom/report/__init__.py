"""report: a dataset and training runs as one self-contained HTML page (Jinja2 + Plotly).

Rendering only: `figures` makes Plotly divs (and spectrogram PNGs) from plain data, `page` renders
the page. What goes on it is gathered by `jobs/report.py` from the catalog and run folders.
"""
