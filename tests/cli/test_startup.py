"""The command line's start-up."""

import subprocess
import sys


def test_the_command_line_parses_without_importing_torch():
    """``dpvr account|calibrate`` and every ``--help`` answer without torch's import (about a second): the
    subcommands that need it import it when they run."""
    code = ("import sys\nfrom dpvr.cli import build_parser\nbuild_parser()\n"
            "print(sorted(m for m in ('torch', 'dpvr.optim', 'dpvr.audit') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
