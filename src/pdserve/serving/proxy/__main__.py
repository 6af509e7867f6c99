"""``python -m pdserve.serving.proxy --prefill URL... --decode URL...``: see
:mod:`pdserve.serving.proxy.cli`."""

import sys

from pdserve.serving.proxy.cli import module_main

sys.exit(module_main())
