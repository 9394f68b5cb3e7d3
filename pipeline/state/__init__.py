"""What a run writes down about itself: `resume.py`, the sealed state a run resumes from (each
stage's state nested under its key), and `summary.py`, the run's summary (`summary.json`).
"""
