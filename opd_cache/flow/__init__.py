"""Flow control between the stages: the one staleness rule (staleness.py) and the trainer's announced demand
(demand.py)."""
