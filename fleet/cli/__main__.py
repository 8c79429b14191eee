"""`python -m fleet.cli`: the CLI, as the tests and scripts run it."""

from fleet.cli import main

main()
