"""``python -m pdserve.serving.launch TOPOLOGY.yaml``: see :mod:`pdserve.serving.launch.cli`."""

import sys

from pdserve.serving.launch.cli import add_cli_args, main
from pdserve.serving.module_cli import module_main

sys.exit(module_main("python -m pdserve.serving.launch", add_cli_args, main))
