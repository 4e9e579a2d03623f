"""Makes ts_testing (the shared builders beside this file) importable under
pytest's importlib import mode."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
