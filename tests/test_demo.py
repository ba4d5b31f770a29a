"""The demo's terminal output: only its progress bar and table, everything
else (log lines, C-level prints, third-party warnings) in its log file."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import vllm_lookahead

REPO = Path(__file__).resolve().parent.parent
OWN_FILE = str(Path(vllm_lookahead.__file__).parent / "worker.py")


def test_output_to_log_keeps_the_terminal_for_the_bar_and_the_table(tmp_path) -> None:
    """Python prints, a log handler on stderr, writes to fds 1 and 2 (as C
    code makes them) and a third-party warning go to the log; what is written
    to the yielded streams, and a warning raised in vllm_lookahead's own code,
    reach the terminal; afterwards fds 1 and 2 are the terminal's again."""
    log = tmp_path / "sub" / "demo.log"
    script = textwrap.dedent(f"""
        import logging, os, sys, warnings
        from pathlib import Path
        from vllm_lookahead.demo import output_to_log

        logging.basicConfig(stream=sys.stderr, format="%(levelname)s %(message)s")
        with output_to_log(Path({str(log)!r})) as (out, err):
            print("INFO a print")
            logging.getLogger("vllm.x").warning("a log line")
            os.write(1, b"INFO from C on fd 1\\n")
            os.write(2, b"Warning: from C on fd 2\\n")
            warnings.warn_explicit("third-party", FutureWarning, "/elsewhere/mod.py", 3)
            warnings.warn_explicit("our own", UserWarning, {OWN_FILE!r}, 7)
            print("the table", file=out)
            print("the bar", file=err)
        print("after")
        os.write(2, b"after on fd 2\\n")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "the table\nafter\n"
    assert "our own" in proc.stderr and "the bar" in proc.stderr
    assert "after on fd 2" in proc.stderr
    for hidden in ("INFO", "a log line", "Warning: from C", "third-party"):
        assert hidden not in proc.stderr
    text = log.read_text()
    for line in ("INFO a print", "WARNING a log line", "INFO from C on fd 1",
                 "Warning: from C on fd 2", "FutureWarning: third-party"):
        assert line in text
    assert "our own" not in text and "the table" not in text
