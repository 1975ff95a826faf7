"""Tables with a CSV download, and trace downloads (Parquet / CSV, generated only when clicked)."""
from __future__ import annotations

import io

import numpy as np
import pandas as pd
import streamlit as st

from recur_core.exits.trace_type import Trace


def csv_bytes(df: pd.DataFrame) -> bytes:
    return df.to_csv(index=False).encode()


MISSING = "n/a"


def readable(df: pd.DataFrame) -> pd.DataFrame:
    """The table as shown: st.dataframe prints a missing value (None, NaN) as the word "None", so a
    column with any shows them as "n/a" and its numbers as text (4 significant digits)."""
    out = df.copy()
    for col in out.columns:
        missing = out[col].isna()
        if missing.any():
            out[col] = [MISSING if gone else f"{v:.4g}" if isinstance(v, (float, np.floating)) else v
                        for v, gone in zip(out[col], missing, strict=True)]
    return out


def table(df: pd.DataFrame, name: str, caption: str | None = None, **dataframe_kwargs) -> None:
    """st.dataframe (missing values as "n/a") plus a "CSV" download of exactly that table."""
    st.dataframe(readable(df), hide_index=True, **dataframe_kwargs)
    cols = st.columns([1, 5])
    cols[0].download_button("⬇ CSV", data=lambda: csv_bytes(df), file_name=f"{name}.csv", mime="text/csv",
                            key=f"csv-{name}", on_click="ignore", help=f"Download this table ({len(df)} rows)")
    if caption:
        cols[1].caption(caption)


def trace_buttons(tr: Trace, name: str) -> None:
    """Parquet and CSV downloads of a trace: one row per window × token × loop."""
    def parquet() -> bytes:
        buf = io.BytesIO()
        tr.to_frame().to_parquet(buf, index=False)
        return buf.getvalue()

    rows = tr.n_windows * tr.seq_len * tr.max_loops
    c1, c2, c3 = st.columns([1, 1, 4])
    c1.download_button("⬇ Trace (Parquet)", data=parquet, file_name=f"{name}.parquet",
                       mime="application/vnd.apache.parquet", key=f"parquet-{name}", on_click="ignore")
    c2.download_button("⬇ Trace (CSV)", data=lambda: csv_bytes(tr.to_frame()), file_name=f"{name}.csv",
                       mime="text/csv", key=f"tracecsv-{name}", on_click="ignore")
    c3.caption(f"{rows:,} rows (window × token × loop): KL, state change, loss, entropy, argmax, top-{tr.topk}.")
