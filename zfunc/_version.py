"""zfunc's version (its own module so that any layer may read it without importing the package)."""

VERSION = "0.1.0"
