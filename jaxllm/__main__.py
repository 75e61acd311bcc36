"""`python -m jaxllm ...` is the `jaxllm` command, for a checkout or an environment without its script."""

import sys

from jaxllm.cli.main import main

sys.exit(main())
