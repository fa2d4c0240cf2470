"""python -m lab <table> [--seeds=3 --rows=a,b --report=True --root=DIR --rerun=True]: a table of
lab/tables.py, run by lab/runner.py (--rerun=True: every run trained here, none taken from the committed
table)."""
from tools.flags import stop_on_ctrl_c
stop_on_ctrl_c(__name__)  # while the imports below load: Ctrl-C stops at once, no traceback

import sys

from lab.runner import main

sys.exit(main(sys.argv[1:]))
