"""The benchmarks' shared parts: common (results files and how each was made, child processes, waiting, the
databases kept in the repo), samplers (CPU and GPU load over a window, a run second by second), stock (stock
MetaSchedule in its own process), jobs (a job on a local stack and its records), serving (tuned models compiled
and timed). What the benchmarks compute from their runs is in sharetune.experiments (time_to_quality,
throughput, share_matrix) and the testing kit (sharetune.testing.faults)."""
