"""`recur-app [CHECKPOINT]`: start the Streamlit app (app.py beside this package) on a checkpoint.

The app is a Streamlit script with its pages in pages/, so it runs from a source tree: an editable
install (`pip install -e .`) or a clone. Any further arguments go to `streamlit run`.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

APP = Path(__file__).resolve().parents[1] / "app.py"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="recur-app", description="Start the recur Streamlit app.",
                                epilog="Further arguments go to `streamlit run` (e.g. --server.address 0.0.0.0).")
    p.add_argument("checkpoint", nargs="?", help="checkpoint folder to open first (default: the app's own choice, "
                                                 "checkpoints/specimen in the source tree)")
    p.add_argument("--port", type=int, default=8501)
    args, streamlit_args = p.parse_known_args(argv)
    if not APP.is_file():
        sys.exit(f"recur-app: {APP} not found; the app runs from a source tree (git clone, then pip install -e .)")
    env = dict(os.environ)
    if args.checkpoint:
        folder = Path(args.checkpoint).expanduser().resolve()
        if not folder.is_dir():
            sys.exit(f"recur-app: checkpoint folder {folder} not found")
        env["RECUR_CHECKPOINT"] = str(folder)
    cmd = [sys.executable, "-m", "streamlit", "run", str(APP), "--server.port", str(args.port),
           "--server.headless", "true", "--browser.gatherUsageStats", "false", *streamlit_args]
    sys.exit(subprocess.call(cmd, env=env, cwd=APP.parent))
