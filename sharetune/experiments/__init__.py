"""The experiments run on top of the client: the tuned-at x served-at share matrix (share_matrix.py), the
timing of compiled models in a process placed at a share (model_timing.py, also what
`Client.latency_us` runs), a job's HTML report (report.py, with its Jinja2 template in templates/), and
time to quality from a run's measured trials (time_to_quality.py)."""
