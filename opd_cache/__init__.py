"""opd_cache: on-policy distillation with the teacher's outputs as a dataset."""

__version__ = "0.1.0"
