"""kvcal's command line. `app` is the console script entry point; each module below registers its commands.

One module per area, each owning its commands: capacity, calibrate, scalefile (show/verify/export),
evaluate (eval, models), compare (sweep, compare), sensitivity.
"""

from kvcal.cli import calibrate as _calibrate  # noqa: F401
from kvcal.cli import capacity as _capacity  # noqa: F401  (each import registers commands)
from kvcal.cli import compare as _compare  # noqa: F401
from kvcal.cli import evaluate as _evaluate  # noqa: F401
from kvcal.cli import scalefile as _scalefile  # noqa: F401
from kvcal.cli import sensitivity as _sensitivity  # noqa: F401
from kvcal.cli._app import app

__all__ = ["app"]
