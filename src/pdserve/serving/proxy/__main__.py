"""``python -m pdserve.serving.proxy --prefill URL... --decode URL...``: see
:mod:`pdserve.serving.proxy.cli`."""

import sys

from pdserve.serving.module_cli import module_main
from pdserve.serving.proxy.cli import add_cli_args, main

sys.exit(module_main("python -m pdserve.serving.proxy", add_cli_args, main))
