"""deepgen's version: a leaf module anyone may import (the generated README and
manifest name it)."""

__version__ = "0.1.0"
