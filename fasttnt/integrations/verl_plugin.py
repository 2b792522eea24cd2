"""Registers fasttnt's policy loss and GRPO advantage estimator with verl when imported: the module verl's plugin
hooks import (the ``verl.plugins`` entry point fasttnt declares, or ``VERL_USE_EXTERNAL_MODULES``), so that every
Ray worker has them. fasttnt's one module whose import does something; ``fasttnt.integrations.verl.register`` is the
explicit call."""

from .verl import register

register()
