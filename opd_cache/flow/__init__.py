"""Flow control between the stages: the one staleness rule (staleness.py), the trainer's announced demand
(demand.py), its schedule and the admission rule (schedule.py, issue #25), and `opd plan`'s pipeline model
(events.py, spec.py, simulate.py, calibrate.py, suggest.py; docs/flow-control.md)."""
