"""What a user runs: the `deepgen` command line (cli.py), building a generated
project (build.py) and the installed-package checks that protect it (installed.py)."""
