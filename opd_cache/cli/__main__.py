"""`python -m opd_cache.cli …`: the entry point `torchrun` uses for the trainer."""

from opd_cache.cli import main

main()
