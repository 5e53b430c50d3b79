"""``python -m sparktrain.ml.paramgen [--check | --print]``: see :mod:`sparktrain.ml.paramgen`."""

import sys

from sparktrain.ml.paramgen import main

sys.exit(main())
