"""Starting the stages: `opd run` on local processes (run.py) or on Ray (ray_launcher.py, ray_actor.py), and the
CPU demo (`opd demo`: demo.py, its files in demo_assets.py)."""
