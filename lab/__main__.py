"""python -m lab <table> [--seeds=3 --rows=a,b --report=True --root=DIR]: the lab's tables (lab/tables.py)."""
import sys

from lab.tables import main

sys.exit(main(sys.argv[1:]))
