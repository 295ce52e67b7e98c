"""`shoal.metrics`: step time, samples, loss and your own metrics, labelled by rank.

The implementation lives in the elastic layer (`shoal.elastic.training_metrics`, which only
needs core's telemetry); this module is the short name training code imports, outside the
layer folders, like `shoal` itself. See that module's docstring and the README's
"Observability" section.
"""

from shoal.elastic.training_metrics import *  # noqa: F403
from shoal.elastic.training_metrics import __all__  # noqa: F401
