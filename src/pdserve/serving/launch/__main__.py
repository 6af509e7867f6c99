"""``python -m pdserve.serving.launch TOPOLOGY.yaml``: see :mod:`pdserve.serving.launch.cli`."""

import sys

from pdserve.serving.launch.cli import module_main

sys.exit(module_main())
