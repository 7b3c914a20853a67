"""`python -m specdec ...`: see specdec.cli."""

from specdec.cli import main

main()
