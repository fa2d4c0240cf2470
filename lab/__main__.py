"""python -m lab <table> [--seeds=3 --rows=a,b --report=True --root=DIR --rerun=True]: a table of
lab/tables.py, run by lab/runner.py (--rerun=True: every run trained here, none taken from the
committed table)."""
import signal
if __name__ == "__main__":  # Ctrl-C while the imports load: stop at once, no traceback
    # (flags.parse restores the handler)
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import sys

from lab.runner import main

sys.exit(main(sys.argv[1:]))
