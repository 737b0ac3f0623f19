"""`python -m orchestrator.cli ...`: the same as `spac ...`."""

from orchestrator.cli.main import main

main()
