"""``python -m vllm_lookahead.tools ...``: see :mod:`vllm_lookahead.tools.cli`."""

import sys

from vllm_lookahead.tools.cli import main

sys.exit(main())
