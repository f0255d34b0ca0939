"""python -m c10d_ext.trace {merge,analyze} ..."""
import sys

from . import main

sys.exit(main())
