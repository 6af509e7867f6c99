"""``python -m pdserve.serving.<role>``: a role's command line run on its own, with the
same logging set-up as ``pdserve <role>``."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def module_main(
    prog: str,
    add_cli_args: Callable[[argparse.ArgumentParser], None],
    main: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None = None,
) -> int:
    """Parse ``argv`` with the role's flags plus ``--log-level``, set up logging, run."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--log-level", default="INFO")
    add_cli_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    return main(args)
