"""`python -m fleet`: the CLI, where no `fleet` script is installed (the GPU bench's machine)."""

from fleet.cli import main

main()
