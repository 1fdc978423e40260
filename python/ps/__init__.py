"""``ps``: the package's first import name, kept so that existing scripts run unchanged.

The package is ``ps_torch`` (the distribution ``ps-torch``); ``ps`` is a generic top-level name
that another distribution may install too, so new code should write ``import ps_torch as ps``.
``import ps`` gives the ``ps_torch`` module itself (``ps.Worker is ps_torch.Worker``, also
``from ps import _native``); nothing else lives here.
"""

import sys

import ps_torch
from ps_torch import *  # noqa: F401,F403  (for type checkers: the same names as ps_torch)
from ps_torch import __version__  # noqa: F401

sys.modules[__name__] = ps_torch
