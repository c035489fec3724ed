"""`python -m gstrain` is the same as the `gstrain` command."""

from gstrain.cli import main

main()
