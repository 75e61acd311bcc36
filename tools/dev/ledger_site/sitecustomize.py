"""Put on a command line's PYTHONPATH by the tests when JAXLLM_COMPILE_LEDGER is set: once `jax` has
been imported, record its compiles into the ledger (tools/dev/compile_ledger.py). Nothing else changes."""

import importlib.abc
import os
import sys


class _AfterJax(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "jax":
            return None
        sys.meta_path.remove(self)
        from importlib.util import find_spec

        spec = find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            from tools.dev.compile_ledger import ENV, install

            install(os.environ[ENV])

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("JAXLLM_COMPILE_LEDGER"):
    sys.meta_path.insert(0, _AfterJax())
