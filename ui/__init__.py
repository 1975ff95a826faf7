"""Shared pieces of the Streamlit app (app.py + pages/): checkpoint discovery and the sidebar,
cached calls into recur_core, the token strip, Plotly figures and download buttons.

No science lives here: every number comes from recur_core (traces, policies, analysis, stats);
this package only caches, arranges and draws it.
"""
