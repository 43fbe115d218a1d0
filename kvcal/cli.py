"""kvcal's command line: the Typer app the `kvcal` console script runs.

Each module of kvcal/commands/ registers its commands on the app (capacity, calibrate, scalefile:
show/verify/export, evaluate: eval/models, compare: sweep/compare, sensitivity); importing them here assembles it.
"""

from kvcal.commands import calibrate as _calibrate  # noqa: F401  (each import registers commands)
from kvcal.commands import capacity as _capacity  # noqa: F401
from kvcal.commands import compare as _compare  # noqa: F401
from kvcal.commands import evaluate as _evaluate  # noqa: F401
from kvcal.commands import scalefile as _scalefile  # noqa: F401
from kvcal.commands import sensitivity as _sensitivity  # noqa: F401
from kvcal.commands._app import app

__all__ = ["app"]
