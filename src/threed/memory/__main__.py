"""`python -m threed.memory ...`: the entry point users' scripts call; the command is `threed memory`
(`threed.cli.memory`, which this runs), with training's flag names."""

import sys

from threed.cli.memory import main

sys.exit(main())
