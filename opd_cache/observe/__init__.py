"""What a run did: append-only metrics (metrics.py), experiment trackers (tracking.py), plain progress lines
(progress.py) and the plots and summary of `opd report` (report.py)."""
