"""Makes disk_testing (the disk tier tests' shared helpers, beside this file) importable under pytest's importlib
import mode, which puts no test directory on sys.path."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
