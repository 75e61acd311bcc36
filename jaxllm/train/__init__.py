"""The trainer: the step, the loop, checkpoints, metrics.

`jaxllm.train` is this package and also the API's `train(config)` (`jaxllm/api.py`): importing a module of the
package makes `jaxllm.train` the package, so the package itself is callable, `jaxllm.train(config)`.
"""

import sys
import types


class _CallablePackage(types.ModuleType):
    def __call__(self, config):
        from jaxllm.api import train

        return train(config)


sys.modules[__name__].__class__ = _CallablePackage
