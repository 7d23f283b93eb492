"""A lane's timing beside builds at each batch priority: sharetune/testing/timing_contention.py."""
import sys

from bench.harness.common import write_results
from bench.panel import build
from sharetune.testing.timing_contention import main

if __name__ == "__main__":
    sys.exit(main(build, write_results))
