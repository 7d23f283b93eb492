"""The benchmarks' shared parts: common (results files and how each was made, child processes, waiting), samplers
(CPU and GPU load over a window), stock (stock MetaSchedule, in its own process, and its logs), jobs (a job on a
local stack and its records), serving (tuned models compiled and timed), timeline (a run second by second)."""
