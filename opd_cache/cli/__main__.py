"""`python -m opd_cache.cli …`: the entry point `torchrun` uses for the trainer."""

from opd_cache.cli import main

# The guard matters: vLLM starts its engine processes with spawn, which re-imports this module.
if __name__ == "__main__":
    main()
