"""The kill-anything test (`pytest tests/chaos -m chaos`): driver.py kills, invariants.py checks the store."""
