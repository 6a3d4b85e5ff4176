"""`vramledger ui`: a local page where batch, length and every remedy move the bill live.

The server is the standard library's ``http.server`` (no extra to install); the page is one HTML file, one
stylesheet and one script shipped in ``ui/static/`` that draw their charts in SVG themselves, so the page works
with no network at all. Every number on it comes from the library through the JSON API (``ui/api.py``), which
reads a request with the CLI's own parser (``ui/request.py``) and answers with the CLI's own ``--json``.
"""
