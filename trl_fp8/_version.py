"""The package version, in a module of its own: anything inside trl_fp8 that needs it imports it from here, never
from the package's ``__init__``."""

__version__ = "0.1.0"
