"""The benchmarks' shared parts: common (paths, code state, reports, child processes), samplers (CPU and GPU
load over a window), stock (stock MetaSchedule, in its own process, and its logs), jobs (a job on a local
stack and its records), serving (tuned models compiled and timed)."""
